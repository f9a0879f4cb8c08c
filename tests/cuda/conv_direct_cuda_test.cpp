// Note [Direct convolutions of a few input channels] (cuda/conv/conv_direct.h): the
// direct forward and weight gradient against the CPU's convolution on the same
// 16-bit-exact values -- strides, paddings, dilation, kernel sizes, 1 to 4
// input channels, 8 to 64 outputs, pixel counts that leave a partial tile --
// with the weight gradient written in float32 and in the data's dtype, at a
// channels-last and at a contiguous filter's strides; the same bits from two
// runs; then the ops with the path allowed (timed against cuDNN) against it
// turned off, and what the path refuses.
#ifdef CHORUS_WITH_CUDA

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <chorus/chorus.h>
#include <chorus/cuda/conv/conv_direct.h>
#include <chorus/ops/copy.h>
#include <chorus/ops/nn.h>

#include "testing/compare.h"
#include "testing/conv_cases.h"

namespace chorus {
namespace {

namespace F = nn::functional;

const std::vector<test::ConvCase>& direct_cases() {
  static const std::vector<test::ConvCase> cases{
      {4, 3, 16, 16, 16, 3, 1, 1, 1},   // Wide ResNet's stem, small
      {3, 3, 11, 9, 24, 3, 2, 1, 1},    // strided, odd sizes, 8 outputs a chunk
      {2, 1, 10, 10, 8, 1, 1, 0, 1},    // one channel, 1x1
      {2, 4, 9, 9, 64, 3, 1, 2, 2},     // four channels, dilated, 64 outputs
      {2, 2, 13, 12, 32, 5, 2, 2, 1},   // 5x5 (50 taps), strided
      {5, 3, 17, 15, 16, 3, 1, 1, 1},   // 1275 pixels: a partial last tile
      {128, 3, 32, 32, 16, 3, 1, 1, 1}, // Wide ResNet's stem itself: blocks take several tiles
  };
  return cases;
}


TEST(ConvDirect, MatchesTheCpuConvolution_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const Device gpu = cuda_device(0);
  for (DType dt : {kBFloat16, kFloat16})
    for (const test::ConvCase& c : direct_cases()) {
      const std::string what = c.name(dt);
      manual_seed(static_cast<uint64_t>(c.c * 13 + c.kernel * 5 + c.stride + c.k));
      const F::Conv2dParams p = c.params();
      const Conv2dGeometry g = c.geometry();
      ASSERT_TRUE(cuda::conv_direct_applies(g, cuda::Layout::NHWC, dt)) << what;
      // Values exact in the dtype, so both sides see the same inputs.
      const Tensor x = randn({c.n, c.c, c.h, c.w}).to(dt).to(kFloat32);
      const Tensor w = randn({c.k, c.c, c.kernel, c.kernel}).mul(0.2).to(dt).to(kFloat32);
      const Tensor ref_y = F::conv2d(x, w, Tensor(), p);
      const Tensor dy = randn(ref_y.sizes()).to(dt).to(kFloat32);
      const Tensor ref_dw = ops::conv2d_backward_weight(dy, x, w, p, false).first;

      const Tensor gx = test::channels_last_on(x, gpu, dt), gw = test::channels_last_on(w, gpu, dt);
      const Tensor gdy = test::channels_last_on(dy, gpu, dt);
      // Outputs start as noise: every element must be written.
      const Tensor y = test::channels_last_on(randn(ref_y.sizes()), gpu, dt);
      cuda::conv_direct_forward(g, gx, gw, y);
      // One rounding of y (2^-8 relative for bf16); the sums are in float.
      const double tol = dt == kBFloat16 ? 1e-2 : 2e-3;
      EXPECT_LT(test::rel_err(y, ref_y), tol) << what << " forward";
      // Into a y that is not 16-byte aligned (a view one element in): the
      // scalar stores.
      {
        const Tensor base = randn({ref_y.numel() + 1}).to(gpu).to(dt);
        const int64_t oh = ref_y.size(2), ow = ref_y.size(3);
        const Tensor y1 = detail::make_view(base, ref_y.sizes(), {oh * ow * c.k, 1, ow * c.k, c.k}, 1);
        cuda::conv_direct_forward(g, gx, gw, y1);
        EXPECT_LT(test::rel_err(y1, ref_y), tol) << what << " forward, unaligned output";
      }
      // The weight gradient: float32 at a contiguous (OIHW) filter's strides,
      // and the data's dtype at channels-last strides.
      const Tensor dw32 = randn(w.sizes()).to(gpu);
      const Tensor dw16 = test::channels_last_on(randn(w.sizes()), gpu, dt);
      cuda::conv_direct_backward_weight(g, gdy, gx, dw32);
      cuda::conv_direct_backward_weight(g, gdy, gx, dw16);
      // Float sums in two orders over up to 131072 pixels; a 16-bit result
      // would be off by ~4e-3.
      EXPECT_LT(test::rel_err(dw32, ref_dw), 1e-4) << what << " weight gradient, float32";
      EXPECT_LT(test::rel_err(dw16, ref_dw), tol) << what << " weight gradient, " << dtype_name(dt);
      // The sums are in a fixed order: a second run writes the same bits.
      const Tensor again = randn(w.sizes()).to(gpu);
      cuda::conv_direct_backward_weight(g, gdy, gx, again);
      EXPECT_EQ(test::rel_err(again, dw32), 0.0) << what << " weight gradient run to run";
    }
}

TEST(ConvDirect, OpsWithThePathAgreeWithCudnn_CUDA) {
  // Through the ops: with the path allowed each geometry and direction is timed
  // against cuDNN and runs the faster; off, cuDNN runs. Both agree to the
  // dtype's rounding, and the path is refused for what it cannot do.
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const Device gpu = cuda_device(0);
  struct Restore {
    ~Restore() { cuda::set_conv_direct_enabled(true); }
  } restore;
  const test::ConvCase c{32, 3, 32, 32, 16, 3, 1, 1, 1};
  const F::Conv2dParams p{1, 1, 1, 1, 1, 1, 1};
  manual_seed(5);
  const Tensor x = test::channels_last_on(randn({c.n, c.c, c.h, c.w}), gpu, kBFloat16);
  const Tensor w = test::channels_last_on(randn({c.k, c.c, 3, 3}).mul(0.2), gpu, kBFloat16);
  const Tensor dy = test::channels_last_on(randn({c.n, c.k, c.h, c.w}), gpu, kBFloat16);
  std::vector<Tensor> got[2];
  int64_t runs[2];
  for (int on = 0; on < 2; ++on) {
    cuda::set_conv_direct_enabled(on == 1);
    const int64_t before = cuda::conv_direct_runs();
    got[on] = {F::conv2d(x, w, Tensor(), p), ops::conv2d_backward_weight(dy, x, w, p, false, kFloat32).first,
               ops::conv2d_backward_weight(dy, x, w, p, false).first};
    runs[on] = cuda::conv_direct_runs() - before;
  }
  // Off, the ops never reach the kernels; on, each direction is at least
  // timed (and runs from then on when it won).
  EXPECT_EQ(runs[0], 0);
  EXPECT_GE(runs[1], 3);
  EXPECT_LT(test::rel_err(got[1][0], got[0][0]), 1e-2);
  EXPECT_LT(test::rel_err(got[1][1], got[0][1]), 1e-2);
  EXPECT_LT(test::rel_err(got[1][2], got[0][2]), 1e-2);
  EXPECT_EQ(got[1][1].dtype(), kFloat32);
  EXPECT_EQ(got[1][2].dtype(), kBFloat16);
  // What the path leaves to cuDNN: NCHW, float32, grouped, more than 4 input
  // channels, more than 64 taps, outputs not a multiple of 8 or above 64.
  const Conv2dGeometry g{c.n, c.c, c.h, c.w, c.k, 3, 3, 1, 1, 1, 1, 1, 1, 1};
  EXPECT_TRUE(cuda::conv_direct_applies(g, cuda::Layout::NHWC, kBFloat16));
  EXPECT_FALSE(cuda::conv_direct_applies(g, cuda::Layout::NCHW, kBFloat16));
  EXPECT_FALSE(cuda::conv_direct_applies(g, cuda::Layout::NHWC, kFloat32));
  Conv2dGeometry grouped = g, five = g, wide_taps = g, odd_out = g, many_out = g;
  grouped.groups = 3;
  five.c_in = 5;
  wide_taps.kh = wide_taps.kw = 5;  // 75 taps for 3 channels
  odd_out.c_out = 12;
  many_out.c_out = 72;
  EXPECT_FALSE(cuda::conv_direct_applies(grouped, cuda::Layout::NHWC, kBFloat16));
  EXPECT_FALSE(cuda::conv_direct_applies(five, cuda::Layout::NHWC, kBFloat16));
  EXPECT_FALSE(cuda::conv_direct_applies(wide_taps, cuda::Layout::NHWC, kBFloat16));
  EXPECT_FALSE(cuda::conv_direct_applies(odd_out, cuda::Layout::NHWC, kBFloat16));
  EXPECT_FALSE(cuda::conv_direct_applies(many_out, cuda::Layout::NHWC, kBFloat16));
}

}  // namespace
}  // namespace chorus

#endif  // CHORUS_WITH_CUDA
