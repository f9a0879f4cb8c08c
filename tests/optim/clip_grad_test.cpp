// optim::clip_grad_norm_: the global norm of many gradients (more than one
// multi-tensor launch takes, one of them a strided view) and the scale, against
// sums in double written here; on a GPU, float32 and bfloat16 against the same.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include <chorus/chorus.h>
#include <chorus/optim/clip_grad.h>

#include "testing/gradcheck.h"

namespace chorus {
namespace {

struct Params {
  std::vector<Tensor> params;
  std::vector<std::vector<double>> grads;  // as set, in double
  double norm = 0;
};

// 150 parameters of assorted sizes (one whose gradient is a transposed view,
// one a view at an odd offset, one of 65750 elements: several of the CUDA
// norm's chunks and a part of one, Note [Squares in chunks]), each with a
// random gradient on `dev` in `dt`.
Params make(Device dev, DType dt) {
  Params p;
  double sq = 0;
  for (int i = 0; i < 150; ++i) {
    const int64_t rows = i == 7 ? 250 : 1 + (i * 7) % 13, cols = i == 7 ? 263 : 1 + (i * 5) % 300;
    Tensor w = zeros({rows, cols}, {dt, dev}).set_requires_grad(true);
    Tensor g = test::random_leaf({rows, cols}, 200 + i).detach().mul(0.5);
    if (i == 3) g = test::random_leaf({cols, rows}, 200 + i).detach().mul(0.5).t();  // not contiguous
    g = g.to(dt);
    Tensor on_dev = g.to(dev);
    // Contiguous at an odd offset on the device: its data not 16-byte aligned
    // (the norm's vector loads take aligned tensors only).
    if (i == 5) {
      on_dev = test::random_leaf({rows + 1, cols}, 200 + i).detach().mul(0.5).to(dt).to(dev).narrow(0, 1, rows);
      g = on_dev.to(cpu_device(0));
    }
    std::vector<double> v = g.to(kFloat64).contiguous().to_vector<double>();
    for (double x : v) sq += x * x;
    w.set_grad(on_dev);
    p.params.push_back(w);
    p.grads.push_back(v);
  }
  p.norm = std::sqrt(sq);
  return p;
}

void expect_clipped(const Params& p, const Tensor& norm, double max_norm, double tol) {
  // To the host first: CUDA has no float64 conversions.
  EXPECT_NEAR(norm.to(cpu_device(0)).to(kFloat64).item(), p.norm, tol * p.norm);
  const double coef = std::min(1.0, max_norm / (p.norm + 1e-6));
  for (size_t i = 0; i < p.params.size(); ++i) {
    auto got = p.params[i].grad().to(cpu_device(0)).to(kFloat64).contiguous().to_vector<double>();
    ASSERT_EQ(got.size(), p.grads[i].size());
    for (size_t j = 0; j < got.size(); ++j)
      ASSERT_NEAR(got[j], p.grads[i][j] * coef, tol * (std::abs(p.grads[i][j]) + 1e-3)) << "parameter " << i;
  }
}

TEST(ClipGradNorm, ScalesEveryGradientByTheGlobalNorm) {
  Params p = make(cpu_device(0), kFloat64);
  ASSERT_GT(p.norm, 2.0);
  expect_clipped(p, optim::clip_grad_norm_(p.params, 1.0), 1.0, 1e-12);
  // Below the limit nothing changes; max_norm 0 only measures.
  Params q = make(cpu_device(0), kFloat64);
  expect_clipped(q, optim::clip_grad_norm_(q.params, 1e9), 1e9, 1e-12);
  Params r = make(cpu_device(0), kFloat64);
  expect_clipped(r, optim::clip_grad_norm_(r.params, 0.0), 1e300, 1e-12);
}

TEST(ClipGradNorm, MatchesTheReferenceOnTheGpu_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  // (Float64 is the CPU's: CUDA's elementwise kernels are float32/16-bit.)
  for (DType dt : {kFloat32, kBFloat16}) {
    SCOPED_TRACE(dtype_name(dt));
    Params p = make(Device("cuda:0"), dt);
    expect_clipped(p, optim::clip_grad_norm_(p.params, 1.0), 1.0, dt == kBFloat16 ? 8e-3 : 1e-5);
  }
}

}  // namespace
}  // namespace chorus
