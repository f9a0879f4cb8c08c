// batch_norm kernels against a double-precision reference written here from
// the definition, and the backward kernels against central finite
// differences (in double) of that reference forward: L = sum(y * dy).
#include "testing/random.h"
#include "chorus/cpu/batch_norm.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <stdexcept>
#include <vector>

namespace chorus::cpu {
namespace {

using chorus::testing::random_vector;

template <typename T>
void expect_close(const std::vector<float>& got, const std::vector<T>& want, double rtol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], rtol * std::max(1.0, std::abs(double(want[i]))))
        << "at index " << i;
  }
}

struct Dims {
  int64_t n, c, h, w;
  int64_t hw() const { return h * w; }
  int64_t size() const { return n * c * h * w; }
  int64_t channel_of(int64_t i) const { return (i / hw()) % c; }
};

struct Stats {
  std::vector<double> mean, var;  // var is biased
};

Stats ref_stats(const Dims& d, const std::vector<double>& x) {
  Stats s{std::vector<double>(d.c, 0.0), std::vector<double>(d.c, 0.0)};
  const double count = double(d.n * d.hw());
  for (int64_t i = 0; i < d.size(); ++i) s.mean[d.channel_of(i)] += x[i] / count;
  for (int64_t i = 0; i < d.size(); ++i) {
    const double dev = x[i] - s.mean[d.channel_of(i)];
    s.var[d.channel_of(i)] += dev * dev / count;
  }
  return s;
}

// y with the given statistics; gamma/beta empty mean ones/zeros.
std::vector<double> ref_normalise(const Dims& d, const std::vector<double>& x,
                                  const std::vector<double>& mean, const std::vector<double>& var,
                                  const std::vector<double>& gamma, const std::vector<double>& beta,
                                  double eps) {
  std::vector<double> y(d.size());
  for (int64_t i = 0; i < d.size(); ++i) {
    const int64_t ch = d.channel_of(i);
    y[i] = (x[i] - mean[ch]) / std::sqrt(var[ch] + eps) * (gamma.empty() ? 1.0 : gamma[ch]) +
           (beta.empty() ? 0.0 : beta[ch]);
  }
  return y;
}

std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// L = sum(y * dy) with y from the training-mode (batch statistics) forward,
// or from the eval-mode forward with fixed statistics when `fixed` is given.
double loss(const Dims& d, const std::vector<double>& x, const std::vector<double>& gamma,
            const std::vector<double>& beta, double eps, const std::vector<float>& dy,
            const Stats* fixed) {
  const Stats s = fixed ? *fixed : ref_stats(d, x);
  const auto y = ref_normalise(d, x, s.mean, s.var, gamma, beta, eps);
  double l = 0.0;
  for (int64_t i = 0; i < d.size(); ++i) l += y[i] * dy[i];
  return l;
}

// Central differences of loss() with respect to every entry of *v.
std::vector<double> finite_differences(std::vector<double>* v, const std::function<double()>& f) {
  const double step = 1e-5;
  std::vector<double> g(v->size());
  for (size_t i = 0; i < v->size(); ++i) {
    const double keep = (*v)[i];
    (*v)[i] = keep + step;
    const double lp = f();
    (*v)[i] = keep - step;
    const double lm = f();
    (*v)[i] = keep;
    g[i] = (lp - lm) / (2 * step);
  }
  return g;
}

void check_train(const Dims& d, bool affine, uint32_t seed, float offset = 0.0f) {
  SCOPED_TRACE(::testing::Message() << "n=" << d.n << " c=" << d.c << " h=" << d.h << " w=" << d.w
                                    << " affine=" << affine << " offset=" << offset);
  const float eps = 1e-5f, momentum = 0.1f;
  const auto x = random_vector(d.size(), seed, offset - 1.0f, offset + 1.0f);
  const auto dy = random_vector(d.size(), seed + 1);
  const auto gamma = random_vector(d.c, seed + 2, 0.5f, 1.5f);
  const auto beta = random_vector(d.c, seed + 3);
  const auto rm0 = random_vector(d.c, seed + 4);
  const auto rv0 = random_vector(d.c, seed + 5, 0.5f, 2.0f);
  const float* g = affine ? gamma.data() : nullptr;
  const float* b = affine ? beta.data() : nullptr;

  std::vector<float> y(d.size()), mean(d.c), invstd(d.c), rm = rm0, rv = rv0;
  batch_norm_forward_train(x.data(), d.n, d.c, d.h, d.w, g, b, eps, momentum, rm.data(), rv.data(),
                           y.data(), mean.data(), invstd.data());

  const auto xd = to_double(x);
  const Stats s = ref_stats(d, xd);
  std::vector<double> gd = affine ? to_double(gamma) : std::vector<double>{};
  std::vector<double> bd = affine ? to_double(beta) : std::vector<double>{};
  expect_close(y, ref_normalise(d, xd, s.mean, s.var, gd, bd, eps), 1e-4);
  expect_close(mean, s.mean, 1e-5);
  std::vector<double> invstd_ref(d.c), rm_ref(d.c), rv_ref(d.c);
  const double count = double(d.n * d.hw());
  for (int64_t ch = 0; ch < d.c; ++ch) {
    invstd_ref[ch] = 1.0 / std::sqrt(s.var[ch] + eps);
    rm_ref[ch] = (1 - momentum) * rm0[ch] + momentum * s.mean[ch];
    rv_ref[ch] = (1 - momentum) * rv0[ch] + momentum * s.var[ch] * count / (count - 1);
  }
  expect_close(invstd, invstd_ref, 1e-5);
  expect_close(rm, rm_ref, 1e-5);
  expect_close(rv, rv_ref, 1e-5);

  std::vector<float> dx(d.size(), std::nanf("")), dgamma(d.c, std::nanf("")),
      dbeta(d.c, std::nanf(""));
  batch_norm_backward(dy.data(), x.data(), d.n, d.c, d.h, d.w, g, mean.data(), invstd.data(),
                      dx.data(), dgamma.data(), dbeta.data());
  auto xv = xd;
  std::vector<double> gv = affine ? gd : std::vector<double>(d.c, 1.0);
  std::vector<double> bv = affine ? bd : std::vector<double>(d.c, 0.0);
  auto f = [&] { return loss(d, xv, gv, bv, eps, dy, nullptr); };
  expect_close(dx, finite_differences(&xv, f), 1e-4);
  expect_close(dgamma, finite_differences(&gv, f), 1e-4);
  expect_close(dbeta, finite_differences(&bv, f), 1e-4);

  // Null outputs are skipped, the others unchanged.
  std::vector<float> dx2(d.size());
  batch_norm_backward(dy.data(), x.data(), d.n, d.c, d.h, d.w, g, mean.data(), invstd.data(),
                      dx2.data(), nullptr, nullptr);
  EXPECT_EQ(dx, dx2);
}

TEST(BatchNormCpu, TrainForwardBackwardNCHW) { check_train({3, 4, 5, 3}, true, 1); }

TEST(BatchNormCpu, TrainForwardBackwardWithoutAffine) { check_train({2, 3, 4, 4}, false, 10); }

TEST(BatchNormCpu, TrainForwardBackwardNC) { check_train({7, 5, 1, 1}, true, 20); }

TEST(BatchNormCpu, TrainForwardBackwardOddPlaneSizes) { check_train({2, 3, 3, 7}, true, 30); }

TEST(BatchNormCpu, TrainLargeMeanKeepsPrecision) {
  // Values near 100 with unit spread: a one-pass sum-of-squares variance
  // would lose most of its digits here.
  check_train({4, 3, 6, 5}, true, 40, 100.0f);
}

TEST(BatchNormCpu, TrainManyChannelsSplitsOverThreads) {
  // Large enough for the CPU pool to split channels.
  const Dims d{8, 64, 16, 16};
  const auto x = random_vector(d.size(), 50);
  std::vector<float> y(d.size()), mean(d.c), invstd(d.c);
  batch_norm_forward_train(x.data(), d.n, d.c, d.h, d.w, nullptr, nullptr, 1e-5f, 0.1f, nullptr,
                           nullptr, y.data(), mean.data(), invstd.data());
  const auto xd = to_double(x);
  const Stats s = ref_stats(d, xd);
  expect_close(y, ref_normalise(d, xd, s.mean, s.var, {}, {}, 1e-5), 1e-4);
}

TEST(BatchNormCpu, EvalForwardBackward) {
  const Dims d{3, 4, 3, 5};
  const float eps = 1e-3f;
  const auto x = random_vector(d.size(), 60);
  const auto dy = random_vector(d.size(), 61);
  const auto gamma = random_vector(d.c, 62, 0.5f, 1.5f);
  const auto beta = random_vector(d.c, 63);
  const auto rm = random_vector(d.c, 64);
  const auto rv = random_vector(d.c, 65, 0.5f, 2.0f);
  std::vector<float> y(d.size());
  batch_norm_forward_eval(x.data(), d.n, d.c, d.h, d.w, gamma.data(), beta.data(), rm.data(),
                          rv.data(), eps, y.data());
  const Stats fixed{to_double(rm), to_double(rv)};
  auto xv = to_double(x), gv = to_double(gamma), bv = to_double(beta);
  expect_close(y, ref_normalise(d, xv, fixed.mean, fixed.var, gv, bv, eps), 1e-5);

  std::vector<float> dx(d.size()), dgamma(d.c), dbeta(d.c);
  batch_norm_backward_eval(dy.data(), x.data(), d.n, d.c, d.h, d.w, gamma.data(), rm.data(),
                           rv.data(), eps, dx.data(), dgamma.data(), dbeta.data());
  auto f = [&] { return loss(d, xv, gv, bv, eps, dy, &fixed); };
  expect_close(dx, finite_differences(&xv, f), 1e-4);
  expect_close(dgamma, finite_differences(&gv, f), 1e-4);
  expect_close(dbeta, finite_differences(&bv, f), 1e-4);
}

TEST(BatchNormCpu, TrainRejectsSingleValuePerChannel) {
  std::vector<float> x(3, 0.5f), y(3), m(3), s(3);
  EXPECT_THROW(batch_norm_forward_train(x.data(), 1, 3, 1, 1, nullptr, nullptr, 1e-5f, 0.1f,
                                        nullptr, nullptr, y.data(), m.data(), s.data()),
               std::invalid_argument);
  EXPECT_THROW(batch_norm_forward_eval(x.data(), 1, 0, 1, 1, nullptr, nullptr, m.data(), s.data(),
                                       1e-5f, y.data()),
               std::invalid_argument);
}

}  // namespace
}  // namespace chorus::cpu
