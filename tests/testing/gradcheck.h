// The shared finite-difference gradient checker (Caffe's GradientChecker,
// src/caffe/test/test_gradient_check_util.hpp, in double).
//
// gradcheck(f, inputs) compares the analytic gradient of
//     L(x) = sum(f(x) * R)
// with central differences (L(x + eps e_j) - L(x - eps e_j)) / (2 eps) for every
// element j of every input that requires grad. R is a fixed random weighting
// of f's output, so every output element matters and a transposed, mis-signed
// or mis-scaled gradient of any single element shows up (a plain sum(f(x))
// would miss, e.g., a softmax gradient, whose rows sum to zero).
//
// The numeric side never uses Chorus's reductions: L is accumulated on the host
// in long double from f's output values, and f runs under NoGradGuard.
//
// An element passes when
//     |analytic - numeric| <= atol + rtol * max(1, |analytic|, |numeric|)
// (Caffe's threshold * max(|a|, |n|, 1)); the failure message names the worst
// element: input index, element (linear and multi-index), analytic, numeric.
//
// Every op is checked in float64 with these default tolerances, convolution,
// pooling and batch norm included: the CPU kernel set computes those in double
// for float64 tensors (cpu/nn_kernels_f64.h) precisely so that no op needs a
// float32 cast and float-sized tolerances here. Only a check through an
// explicit float32 conversion (to_dtype) needs looser options.
//
// Inputs that require grad must be contiguous float64 leaves on a CPU device
// (any logical one): their values are perturbed in place through data<double>().
// Other inputs (integer indices, targets) are passed through untouched. A
// function that draws random numbers (dropout) must reseed inside f so that
// every evaluation sees the same numbers.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <chorus/chorus.h>

namespace chorus::test {

struct GradcheckOptions {
  double eps = 1e-6;
  double rtol = 1e-6;
  double atol = 1e-9;
};

using GradcheckFn = std::function<Tensor(const TensorList&)>;

// ---- inputs --------------------------------------------------------------------

// A float64 tensor on `device` holding exactly `values` (written through the
// pointer, so the values keep all 53 bits), with requires_grad set.
inline Tensor leaf(const std::vector<double>& values, const Shape& shape, Device device = cpu_device(0),
                   bool requires_grad = true) {
  Tensor t = empty(shape, {kFloat64, device});
  EXPECT_EQ(static_cast<int64_t>(values.size()), t.numel()) << "leaf: values do not fill " << shape_str(shape);
  if (!values.empty()) std::memcpy(t.data<double>(), values.data(), values.size() * sizeof(double));
  if (requires_grad) t.set_requires_grad(true);
  return t;
}

// Host random numbers for test inputs: a std::mt19937_64 per call, seeded by
// the caller, so inputs do not depend on the order tests run in and do not use
// Chorus's generator (the thing some tests check).
inline std::vector<double> uniform_values(int64_t n, uint64_t seed, double lo = -1.0, double hi = 1.0) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& e : v) e = dist(gen);
  return v;
}

// Uniform values in [-1, 1], float64, requires grad.
inline Tensor random_leaf(const Shape& shape, uint64_t seed, Device device = cpu_device(0)) {
  return leaf(uniform_values(numel_of(shape), seed), shape, device);
}

// Values in [lo, hi] (use lo > 0 for log, sqrt, division).
inline Tensor random_leaf_in(const Shape& shape, uint64_t seed, double lo, double hi) {
  return leaf(uniform_values(numel_of(shape), seed, lo, hi), shape);
}

// Values with |x| in [margin, 1] and random signs: kinks at 0 (relu, abs) stay
// far from every finite-difference step.
inline Tensor away_from_zero_leaf(const Shape& shape, uint64_t seed, double margin = 0.1) {
  std::vector<double> v = uniform_values(numel_of(shape), seed, margin, 1.0);
  std::vector<double> s = uniform_values(numel_of(shape), seed + 1, -1.0, 1.0);
  for (size_t i = 0; i < v.size(); ++i) v[i] = s[i] < 0 ? -v[i] : v[i];
  return leaf(v, shape);
}

// Distinct values `spacing` apart in random order: no ties for max-type ops,
// and no finite-difference step changes which element wins.
inline Tensor distinct_leaf(const Shape& shape, uint64_t seed, double spacing = 0.05) {
  const int64_t n = numel_of(shape);
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = spacing * static_cast<double>(i - n / 2);
  std::shuffle(v.begin(), v.end(), std::mt19937_64(seed));
  return leaf(v, shape);
}

// ---- the check -------------------------------------------------------------------

namespace gradcheck_detail {

inline std::string multi_index(int64_t linear, const Shape& shape) {
  Shape idx(shape.size());
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
    idx[d] = shape[d] ? linear % shape[d] : 0;
    linear = shape[d] ? linear / shape[d] : 0;
  }
  return shape_str(idx);
}

inline long double weighted_sum(const Tensor& y, const std::vector<double>& r) {
  std::vector<double> v = y.to_vector<double>();
  long double acc = 0;
  for (size_t k = 0; k < v.size(); ++k) acc += static_cast<long double>(v[k]) * r[k];
  return acc;
}

}  // namespace gradcheck_detail

inline ::testing::AssertionResult gradcheck(const GradcheckFn& f, const TensorList& inputs,
                                            GradcheckOptions opt = {}) {
  using ::testing::AssertionFailure;
  std::vector<size_t> checked;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& x = inputs[i];
    if (!x.defined() || !x.requires_grad()) continue;
    if (x.dtype() != kFloat64 || !x.is_contiguous() || !x.device().is_cpu() || !x.is_leaf())
      return AssertionFailure() << "gradcheck: input " << i << " must be a contiguous float64 CPU leaf, got "
                                << x.describe();
    x.zero_grad();
    checked.push_back(i);
  }
  if (checked.empty()) return AssertionFailure() << "gradcheck: no input requires grad";

  // Analytic: backward of sum(f(x) * R).
  Tensor y = f(inputs);
  if (!y.defined()) return AssertionFailure() << "gradcheck: f returned an undefined tensor";
  if (!y.requires_grad()) return AssertionFailure() << "gradcheck: f's output " << y.describe() << " does not require grad";
  const Shape out_shape = y.sizes();
  Tensor r = randn(out_shape, {kFloat64, y.device()});
  const std::vector<double> rv = r.to_vector<double>();
  chorus::sum(chorus::mul(y, r)).backward();
  std::vector<std::vector<double>> analytic;
  for (size_t i : checked) {
    const Tensor& x = inputs[i];
    Tensor g = x.grad();
    if (!g.defined()) {  // unused input: its gradient is zero
      analytic.emplace_back(static_cast<size_t>(x.numel()), 0.0);
      continue;
    }
    if (g.sizes() != x.sizes() || g.dtype() != x.dtype() || g.device() != x.device())
      return AssertionFailure() << "gradcheck: gradient of input " << i << " is " << g.describe() << ", expected "
                                << x.describe();
    analytic.push_back(g.to_vector<double>());
  }

  // Numeric: central differences, f evaluated without recording.
  NoGradGuard no_grad;
  int64_t failures = 0, total = 0;
  double worst_ratio = -1;
  size_t worst_input = 0;
  int64_t worst_elem = 0;
  double worst_a = 0, worst_n = 0;
  for (size_t c = 0; c < checked.size(); ++c) {
    const Tensor& x = inputs[checked[c]];
    double* p = x.data<double>();
    for (int64_t j = 0; j < x.numel(); ++j) {
      const double orig = p[j];
      // Each output is read before the next perturbation: f may return a view
      // of its input (contiguous(), an identity), which the next write changes.
      p[j] = orig + opt.eps;
      Tensor yp = f(inputs);
      if (yp.sizes() != out_shape) return AssertionFailure() << "gradcheck: f's output shape changed under perturbation";
      const long double lp = gradcheck_detail::weighted_sum(yp, rv);
      p[j] = orig - opt.eps;
      Tensor ym = f(inputs);
      if (ym.sizes() != out_shape) return AssertionFailure() << "gradcheck: f's output shape changed under perturbation";
      const long double lm = gradcheck_detail::weighted_sum(ym, rv);
      p[j] = orig;
      const double numeric = static_cast<double>((lp - lm) / (2.0L * opt.eps));
      const double a = analytic[c][static_cast<size_t>(j)];
      const double tol = opt.atol + opt.rtol * std::max({1.0, std::abs(a), std::abs(numeric)});
      const double ratio = std::abs(a - numeric) / tol;
      ++total;
      if (!(ratio <= 1.0)) ++failures;  // NaN fails too
      if (!(ratio <= worst_ratio)) {
        worst_ratio = ratio;
        worst_input = checked[c];
        worst_elem = j;
        worst_a = a;
        worst_n = numeric;
      }
    }
  }
  if (failures == 0) return ::testing::AssertionSuccess();
  const Shape& ws = inputs[worst_input].sizes();
  std::ostringstream os;
  os.precision(12);
  os << "gradcheck: " << failures << " of " << total << " gradient elements out of tolerance (eps " << opt.eps
     << ", rtol " << opt.rtol << ", atol " << opt.atol << "); worst: input " << worst_input << ", element "
     << worst_elem << " " << gradcheck_detail::multi_index(worst_elem, ws) << " of " << shape_str(ws)
     << ": analytic " << worst_a << ", numeric " << worst_n << ", |diff| " << std::abs(worst_a - worst_n)
     << " (" << worst_ratio << "x the tolerance)";
  return AssertionFailure() << os.str();
}

}  // namespace chorus::test
