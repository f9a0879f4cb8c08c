// Note [GELU's gradient with the bias gradient] (cuda/kernels/gelu_grad.cu):
// the fused pass's gradient against the elementwise GeluTanhGrad of the CPU,
// and its column sums against float64 sums of the very values it stored, over
// shapes of vector and scalar columns, rows that are no multiple of the
// block's, float32 and bf16, and bias gradients of d's dtype and float32.
#ifdef CHORUS_WITH_CUDA

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include <chorus/chorus.h>
#include <chorus/cuda/kernels/gelu_grad.h>
#include <chorus/ops/elementwise.h>

namespace chorus {
namespace {

std::vector<double> doubles(const Tensor& t) { return t.to(cpu_device(0), kFloat64).contiguous().to_vector<double>(); }

TEST(GeluGradColsum, MatchesTheCpuAndSumsWhatItStored_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const Device gpu("cuda:0");
  struct Case {
    int64_t rows, cols;
  };
  manual_seed(140);
  for (DType dt : {kFloat32, kBFloat16}) {
    for (Case c : {Case{16384, 3072}, Case{37, 160}, Case{1000, 44}, Case{5, 3}}) {
      for (DType bias_dt : {dt, kFloat32}) {
        SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " " << c.rows << " x " << c.cols << ", bias "
                                          << dtype_name(bias_dt));
        const Tensor d0 = randn({c.rows, c.cols}).to(dt), pre = randn({c.rows, c.cols}).mul(2.0).to(dt);
        // The CPU's elementwise gradient, in float32 from the same rounded inputs.
        const Tensor want = ops::binary(BinaryOp::GeluTanhGrad, d0.to(kFloat32), pre.to(kFloat32));
        Tensor d = d0.to(gpu).contiguous();
        const Tensor db = zeros({c.cols}, {bias_dt, gpu});
        cuda::gelu_tanh_grad_colsum(d, pre.to(gpu).contiguous(), db);
        const std::vector<double> got = doubles(d), ref = doubles(want), sums = doubles(db);
        double big = 1e-30, worst = 0;
        for (size_t i = 0; i < ref.size(); ++i) {
          big = std::max(big, std::abs(ref[i]));
          worst = std::max(worst, std::abs(got[i] - ref[i]));
        }
        EXPECT_LT(worst / big, dt == kFloat32 ? 1e-5 : 1e-2) << "the gradient";
        // The column sums of the stored gradient, in float64.
        std::vector<double> colsum(c.cols, 0.0);
        double scale = 1e-30;
        for (int64_t r = 0; r < c.rows; ++r)
          for (int64_t k = 0; k < c.cols; ++k) {
            colsum[k] += got[r * c.cols + k];
            scale = std::max(scale, std::abs(got[r * c.cols + k]));
          }
        const double tol = (bias_dt == kFloat32 ? 1e-6 : 8e-3) * scale * std::sqrt(double(c.rows)) + 1e-6 * scale;
        for (int64_t k = 0; k < c.cols; ++k)
          ASSERT_NEAR(sums[k], colsum[k], tol + (bias_dt == kFloat32 ? 0.0 : 4e-3 * std::abs(colsum[k])))
              << "column " << k;
      }
    }
  }
  // Operands that do not fit: one clear error.
  const Tensor d = zeros({4, 8}, {kBFloat16, gpu});
  EXPECT_THROW(cuda::gelu_tanh_grad_colsum(d, zeros({4, 8}, {kFloat32, gpu}), zeros({8}, {kFloat32, gpu})), Error);
  EXPECT_THROW(cuda::gelu_tanh_grad_colsum(d, zeros({4, 8}, {kBFloat16, gpu}), zeros({7}, {kFloat32, gpu})), Error);
}

}  // namespace
}  // namespace chorus

#endif  // CHORUS_WITH_CUDA
