// CPU fused optimizer updates against a naive double re-implementation of
// PyTorch's SGD and AdamW formulas, over several steps with fresh random
// gradients each step, plus SGD's one-step closed form.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "chorus/core/error.h"
#include "chorus/cpu/kernels.h"
#include "testing/random.h"

namespace chorus::cpu {
namespace {

using Vec = std::vector<double>;
constexpr int64_t kN = 257;

Tensor tensor_of(const Vec& v) {
  Tensor t = detail::empty_tensor({int64_t(v.size())}, kFloat32, Device(DeviceType::CPU, 0));
  for (size_t i = 0; i < v.size(); ++i) t.data<float>()[i] = static_cast<float>(v[i]);
  return t;
}

Vec values_of(const Tensor& t) {
  return Vec(t.data<float>(), t.data<float>() + t.numel());
}

Vec random_vec(uint32_t seed) { return chorus::testing::random_doubles(kN, seed); }

// Float inputs as the kernels see them, so the references start from the same values.
Vec as_float(Vec v) {
  for (double& e : v) e = static_cast<float>(e);
  return v;
}

void expect_close(const Vec& got, const Vec& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], tol * std::max(1.0, std::abs(want[i]))) << what << " at " << i;
}

struct SgdOptions {
  double lr, momentum, dampening, weight_decay;
  bool nesterov;
};

void ref_sgd(Vec& p, const Vec& g_in, Vec& buf, const SgdOptions& o, bool first) {
  for (size_t i = 0; i < p.size(); ++i) {
    double g = g_in[i] + o.weight_decay * p[i];
    if (o.momentum != 0) {
      buf[i] = first ? g : o.momentum * buf[i] + (1 - o.dampening) * g;
      g = o.nesterov ? g + o.momentum * buf[i] : buf[i];
    }
    p[i] -= o.lr * g;
  }
}

TEST(OptimKernelsCpu, SgdOneStepMatchesClosedForm) {
  const Vec p0 = as_float(random_vec(1)), g = as_float(random_vec(2));
  Tensor param = tensor_of(p0);
  sgd_update(param, tensor_of(g), Tensor(), 0.1, 0.0, 0.0, 0.01, false, true);
  Vec want(kN);
  for (int64_t i = 0; i < kN; ++i) want[i] = p0[i] - 0.1 * (g[i] + 0.01 * p0[i]);
  expect_close(values_of(param), want, 1e-6, "plain sgd");
}

TEST(OptimKernelsCpu, SgdSeveralStepsMatchPyTorchFormulas) {
  const SgdOptions cases[] = {
      {0.1, 0.9, 0.0, 5e-4, true},   // the WRN recipe: Nesterov momentum
      {0.05, 0.9, 0.1, 1e-2, false}, // dampened heavy ball
      {0.2, 0.0, 0.0, 0.0, false},   // no momentum, no buffer
  };
  for (const SgdOptions& o : cases) {
    const std::string what = "momentum=" + std::to_string(o.momentum) +
                             " nesterov=" + std::to_string(o.nesterov);
    Vec p = as_float(random_vec(3)), buf(kN, 0.0);
    Tensor param = tensor_of(p);
    Tensor momentum_buf = o.momentum != 0 ? tensor_of(Vec(kN, 0.0)) : Tensor();
    for (int step = 0; step < 6; ++step) {
      const Vec g = as_float(random_vec(10 + step));
      sgd_update(param, tensor_of(g), momentum_buf, o.lr, o.momentum, o.dampening,
                 o.weight_decay, o.nesterov, step == 0);
      ref_sgd(p, g, buf, o, step == 0);
    }
    expect_close(values_of(param), p, 1e-5, what);
    if (o.momentum != 0) expect_close(values_of(momentum_buf), buf, 1e-5, what + " buffer");
  }
}

TEST(OptimKernelsCpu, AdamWSeveralStepsMatchPyTorchFormulas) {
  const double lr = 1e-2, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.05;
  Vec p = as_float(random_vec(4)), m(kN, 0.0), v(kN, 0.0);
  Tensor param = tensor_of(p), exp_avg = tensor_of(m), exp_avg_sq = tensor_of(v);
  for (int64_t step = 1; step <= 6; ++step) {
    const Vec g = as_float(random_vec(20 + uint32_t(step)));
    adamw_update(param, tensor_of(g), exp_avg, exp_avg_sq, lr, b1, b2, eps, wd, step);
    const double bias1 = 1 - std::pow(b1, step), bias2 = 1 - std::pow(b2, step);
    for (int64_t i = 0; i < kN; ++i) {
      p[i] *= 1 - lr * wd;
      m[i] = b1 * m[i] + (1 - b1) * g[i];
      v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
      p[i] -= lr * (m[i] / bias1) / (std::sqrt(v[i] / bias2) + eps);
    }
  }
  expect_close(values_of(param), p, 1e-5, "param");
  expect_close(values_of(exp_avg), m, 1e-5, "exp_avg");
  expect_close(values_of(exp_avg_sq), v, 1e-5, "exp_avg_sq");
}

TEST(OptimKernelsCpu, MismatchedShapesThrow) {
  Tensor param = tensor_of(random_vec(5)), short_grad = tensor_of({1.0, 2.0});
  EXPECT_THROW(sgd_update(param, short_grad, Tensor(), 0.1, 0, 0, 0, false, true), ValueError);
  EXPECT_THROW(sgd_update(param, param, Tensor(), 0.1, 0.9, 0, 0, false, true), ValueError);
  EXPECT_THROW(adamw_update(param, param, param, short_grad, 0.1, 0.9, 0.99, 1e-8, 0, 1),
               ValueError);
}

}  // namespace
}  // namespace chorus::cpu
