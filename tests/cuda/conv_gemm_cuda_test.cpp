// Note [Convolutions of few input channels as GEMMs] (cuda/conv/conv_gemm.h): the
// GEMM path's forward, data gradient and weight gradient against the CPU's
// convolution on the same bf16-exact values, for strides, paddings and kernel
// sizes the im2col and col2im gathers must get right; then the ops with the
// path allowed (each geometry timed against cuDNN) against the path turned off.
#ifdef CHORUS_WITH_CUDA

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <chorus/chorus.h>
#include <chorus/cuda/conv/conv_gemm.h>
#include <chorus/ops/copy.h>
#include <chorus/ops/nn.h>

#include "testing/compare.h"
#include "testing/conv_cases.h"

namespace chorus {
namespace {

namespace F = nn::functional;

const std::vector<test::ConvCase>& gemm_cases() {
  static const std::vector<test::ConvCase> cases{
      {4, 16, 12, 12, 40, 3, 1, 1, 1},  // Wide ResNet's first block, small
      {3, 16, 11, 9, 24, 3, 2, 1, 1},   // strided, odd sizes: windows skip pixels in col2im
      {2, 8, 10, 10, 16, 1, 1, 0, 1},   // 1x1
      {2, 32, 9, 9, 8, 5, 1, 2, 1},     // 5x5, 32 channels, few outputs
      {2, 8, 12, 12, 16, 3, 1, 2, 2},   // dilated
      {2, 16, 8, 8, 16, 3, 3, 0, 1},    // stride larger than... the kernel's reach skips rows
  };
  return cases;
}


TEST(ConvGemm, MatchesTheCpuConvolution_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const Device gpu = cuda_device(0);
  for (DType dt : {kBFloat16, kFloat16})
    for (const test::ConvCase& c : gemm_cases()) {
      const std::string what = c.name(dt);
      manual_seed(static_cast<uint64_t>(c.c * 13 + c.kernel * 5 + c.stride));
      const F::Conv2dParams p = c.params();
      const Conv2dGeometry g = c.geometry();
      ASSERT_TRUE(cuda::conv_gemm_applies(g, cuda::Layout::NHWC, dt)) << what;
      // Values exact in the dtype, so both sides see the same inputs.
      const Tensor x = randn({c.n, c.c, c.h, c.w}).to(dt).to(kFloat32);
      const Tensor w = randn({c.k, c.c, c.kernel, c.kernel}).mul(0.1).to(dt).to(kFloat32);
      const Tensor ref_y = F::conv2d(x, w, Tensor(), p);
      const Tensor dy = randn(ref_y.sizes()).to(dt).to(kFloat32);
      const Tensor ref_dx = ops::conv2d_backward_input(dy, x, w, p);
      const Tensor ref_dw = ops::conv2d_backward_weight(dy, x, w, p, false).first;

      const Tensor gx = test::channels_last_on(x, gpu, dt), gw = test::channels_last_on(w, gpu, dt);
      const Tensor gdy = test::channels_last_on(dy, gpu, dt);
      // Outputs start as noise: every element must be written.
      const Tensor y = test::channels_last_on(randn(ref_y.sizes()), gpu, dt);
      const Tensor dx = test::channels_last_on(randn(x.sizes()), gpu, dt);
      const Tensor dw = test::channels_last_on(randn(w.sizes()), gpu, dt);
      cuda::conv_gemm_forward(g, gx, gw, y);
      cuda::conv_gemm_backward_input(g, gdy, gw, dx);
      cuda::conv_gemm_backward_weight(g, gdy, gx, dw);
      // One rounding of y and dw (2^-8 relative for bf16); dx sums kh*kw
      // rounded products (the note's price).
      const double tol = dt == kBFloat16 ? 1e-2 : 2e-3;
      EXPECT_LT(test::rel_err(y, ref_y), tol) << what << " forward";
      EXPECT_LT(test::rel_err(dx, ref_dx), 2 * tol) << what << " data gradient";
      EXPECT_LT(test::rel_err(dw, ref_dw), tol) << what << " weight gradient";
    }
}

TEST(ConvGemm, OpsWithThePathAgreeWithCudnn_CUDA) {
  // Through the ops: with the path allowed each geometry and direction is timed
  // against cuDNN and runs the faster; off, cuDNN runs. Both agree with each
  // other to the dtype's rounding, and the path is refused for what it cannot do.
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const Device gpu = cuda_device(0);
  struct Restore {
    ~Restore() { cuda::set_conv_gemm_enabled(true); }
  } restore;
  const test::ConvCase c{8, 16, 16, 16, 64, 3, 1, 1, 1};
  const F::Conv2dParams p{1, 1, 1, 1, 1, 1, 1};
  manual_seed(5);
  const Tensor x = test::channels_last_on(randn({c.n, c.c, c.h, c.w}), gpu, kBFloat16);
  const Tensor w = test::channels_last_on(randn({c.k, c.c, 3, 3}).mul(0.1), gpu, kBFloat16);
  const Tensor dy = test::channels_last_on(randn({c.n, c.k, c.h, c.w}), gpu, kBFloat16);
  std::vector<Tensor> got[2];
  for (int on = 0; on < 2; ++on) {
    cuda::set_conv_gemm_enabled(on == 1);
    got[on] = {F::conv2d(x, w, Tensor(), p), ops::conv2d_backward_input(dy, x, w, p),
               ops::conv2d_backward_weight(dy, x, w, p, false, kFloat32).first};
  }
  EXPECT_LT(test::rel_err(got[1][0], got[0][0]), 1e-2);
  EXPECT_LT(test::rel_err(got[1][1], got[0][1]), 2e-2);
  EXPECT_LT(test::rel_err(got[1][2], got[0][2]), 1e-2);
  EXPECT_EQ(got[1][2].dtype(), kFloat32);
  // What the path leaves to cuDNN: NCHW, float32, grouped, channels not a multiple of 8 or above 32.
  const Conv2dGeometry g{c.n, c.c, c.h, c.w, c.k, 3, 3, 1, 1, 1, 1, 1, 1, 1};
  EXPECT_FALSE(cuda::conv_gemm_applies(g, cuda::Layout::NCHW, kBFloat16));
  EXPECT_FALSE(cuda::conv_gemm_applies(g, cuda::Layout::NHWC, kFloat32));
  Conv2dGeometry grouped = g;
  grouped.groups = 2;
  EXPECT_FALSE(cuda::conv_gemm_applies(grouped, cuda::Layout::NHWC, kBFloat16));
  Conv2dGeometry three = g, wide = g;
  three.c_in = 3;
  wide.c_in = 64;
  EXPECT_FALSE(cuda::conv_gemm_applies(three, cuda::Layout::NHWC, kBFloat16));
  EXPECT_FALSE(cuda::conv_gemm_applies(wide, cuda::Layout::NHWC, kBFloat16));
}

}  // namespace
}  // namespace chorus

#endif  // CHORUS_WITH_CUDA
