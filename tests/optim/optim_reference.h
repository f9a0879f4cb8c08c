// Test support for optim/: random inputs and a plain double re-implementation
// of torch.optim.SGD and torch.optim.AdamW (the formulas of their
// single-tensor code paths), independent of Chorus' kernels.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "chorus/core/device.h"
#include "chorus/core/error.h"
#include "chorus/core/tensor.h"
#include "chorus/ops/factory.h"
#include "testing/random.h"

namespace chorus::optim::testing {

using Vec = std::vector<double>;

// Uniform in [-1, 1), rounded to float so the reference starts where Chorus does.
inline Vec random_vec(size_t n, uint32_t seed) {
  Vec v = chorus::testing::random_doubles(n, seed);
  for (double& e : v) e = static_cast<float>(e);
  return v;
}

inline Tensor param_of(const Vec& v, const Shape& shape) {
  Tensor t = from_vector(v, shape);
  t.set_requires_grad(true);
  return t;
}

inline Vec values(const Tensor& t) {
  std::vector<float> f = t.contiguous().to_vector<float>();
  return Vec(f.begin(), f.end());
}

inline void expect_close(const Vec& got, const Vec& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], tol * std::max(1.0, std::abs(want[i]))) << what << " at " << i;
}

// Runs `f`, expecting exception E whose message contains `needle`.
template <typename E, typename F>
void expect_throw_with(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected an exception containing \"" << needle << "\"";
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message \"" << e.what() << "\" lacks \"" << needle << "\"";
  }
}

// Runs the same optimizer steps on cpu:0 and cuda:0 parameters; the fused
// kernels on both devices must agree (float32, so to rounding).
template <typename MakeOptimizer>
void expect_gpu_matches_cpu(MakeOptimizer make) {
  if (!cuda_is_available()) GTEST_SKIP() << "no CUDA device";
  const Shape shape = {33, 17};
  Tensor cpu_p = param_of(random_vec(numel_of(shape), 7), shape);
  Tensor gpu_p = from_vector(random_vec(numel_of(shape), 7), shape, TensorOptions(kFloat32, cuda_device(0)));
  gpu_p.set_requires_grad(true);
  auto cpu_opt = make(std::vector<Tensor>{cpu_p});
  auto gpu_opt = make(std::vector<Tensor>{gpu_p});
  for (int step = 0; step < 5; ++step) {
    Vec g = random_vec(numel_of(shape), 300 + step);
    cpu_p.set_grad(from_vector(g, shape));
    gpu_p.set_grad(from_vector(g, shape, TensorOptions(kFloat32, cuda_device(0))));
    cpu_opt->step();
    gpu_opt->step();
  }
  for (auto& [name, t] : gpu_opt->state()) EXPECT_EQ(t.device().is_cuda(), t.dim() > 0) << name;
  expect_close(values(gpu_p), values(cpu_p), 1e-6, "cuda vs cpu");
}

struct RefSGD {
  double lr, momentum, dampening, weight_decay;
  bool nesterov;
  Vec buf;  // empty until the first step, as PyTorch's None
  void step(Vec& p, const Vec& grad) {
    Vec d(p.size());
    for (size_t i = 0; i < p.size(); ++i) d[i] = grad[i] + weight_decay * p[i];
    if (momentum != 0) {
      if (buf.empty()) {
        buf = d;
      } else {
        for (size_t i = 0; i < p.size(); ++i) buf[i] = momentum * buf[i] + (1 - dampening) * d[i];
      }
      for (size_t i = 0; i < p.size(); ++i) d[i] = nesterov ? d[i] + momentum * buf[i] : buf[i];
    }
    for (size_t i = 0; i < p.size(); ++i) p[i] -= lr * d[i];
  }
};

struct RefAdamW {
  double lr, beta1, beta2, eps, weight_decay;
  Vec m, v;
  int64_t t = 0;
  void step(Vec& p, const Vec& g) {
    if (m.empty()) m.assign(p.size(), 0.0), v.assign(p.size(), 0.0);
    ++t;
    const double bias1 = 1 - std::pow(beta1, double(t));
    const double bias2 = 1 - std::pow(beta2, double(t));
    for (size_t i = 0; i < p.size(); ++i) {
      p[i] *= 1 - lr * weight_decay;
      m[i] = beta1 * m[i] + (1 - beta1) * g[i];
      v[i] = beta2 * v[i] + (1 - beta2) * g[i] * g[i];
      p[i] -= (lr / bias1) * m[i] / (std::sqrt(v[i]) / std::sqrt(bias2) + eps);
    }
  }
};

}  // namespace chorus::optim::testing
