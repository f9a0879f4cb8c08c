// Note [Bias gradients as column sums] and Note [GELU's gradient with the
// bias gradient] (cuda/kernels/column_sums.cu): plain column sums against
// float64 sums of the same values; the fused pass's gradient against the
// elementwise GeluTanhGrad of the CPU, and its column sums against float64
// sums of the very values it stored. Shapes of vector and scalar columns, rows
// that are no multiple of the block's, float32 and bf16, sums in the data's
// dtype and in float32.
#ifdef CHORUS_WITH_CUDA

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include <chorus/chorus.h>
#include <chorus/cuda/kernels/column_sums.h>
#include <chorus/ops/elementwise.h>

namespace chorus {
namespace {

std::vector<double> doubles(const Tensor& t) { return t.to(cpu_device(0), kFloat64).contiguous().to_vector<double>(); }

// |got - want| within a float32 sum's rounding (float32 sums) or bf16's
// (16-bit sums) of the column's scale.
void expect_sums(const std::vector<double>& got, const std::vector<double>& want, double scale, int64_t rows,
                 bool float_sums) {
  ASSERT_EQ(got.size(), want.size());
  const double tol = (float_sums ? 1e-6 : 8e-3) * scale * std::sqrt(double(rows)) + 1e-6 * scale;
  for (size_t k = 0; k < want.size(); ++k)
    ASSERT_NEAR(got[k], want[k], tol + (float_sums ? 0.0 : 4e-3 * std::abs(want[k]))) << "column " << k;
}

TEST(ColumnSums, MatchFloat64Sums_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const Device gpu("cuda:0");
  manual_seed(141);
  for (DType dt : {kFloat32, kBFloat16}) {
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{16384, 768}, {16384, 2304}, {37, 160}, {1000, 44}, {5, 3}}) {
      for (DType sum_dt : {dt, kFloat32}) {
        SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " " << rows << " x " << cols << ", sums "
                                          << dtype_name(sum_dt));
        const Tensor x = randn({rows, cols}).to(dt);
        const Tensor sums = zeros({cols}, {sum_dt, gpu});
        cuda::column_sums(x.to(gpu).contiguous(), sums);
        const std::vector<double> xv = doubles(x);
        std::vector<double> want(cols, 0.0);
        double scale = 1e-30;
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t k = 0; k < cols; ++k) {
            want[k] += xv[r * cols + k];
            scale = std::max(scale, std::abs(xv[r * cols + k]));
          }
        expect_sums(doubles(sums), want, scale, rows, sum_dt == kFloat32);
      }
    }
  }
  EXPECT_THROW(cuda::column_sums(zeros({4, 8}, {kBFloat16, gpu}), zeros({7}, {kFloat32, gpu})), Error);
}

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
        expect_sums(sums, colsum, scale, c.rows, bias_dt == kFloat32);
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
