// Note [Tensor-core convolutions of few channels] (cuda/conv/conv_mma.h): the
// tensor-core forward against the CPU's convolution on the same
// 16-bit-exact values -- every output-channel count the kernel takes (16 to
// 160), 16 to 160 input channels, 1x1, 3x3 and 5x5 filters, paddings down to
// none, rows 16 to 64 wide, the whole first block of WRN-28-10 at batch 16 --
// into
// outputs that start as noise and at an 8-byte but not 16-byte aligned
// address; then the ops with the path allowed (timed against cuDNN) against
// it turned off, and what the path refuses.
#ifdef CHORUS_WITH_CUDA

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <chorus/chorus.h>
#include <chorus/cuda/conv/conv_mma.h>
#include <chorus/ops/copy.h>
#include <chorus/ops/nn.h>

#include "testing/compare.h"
#include "testing/conv_cases.h"

namespace chorus {
namespace {

namespace F = nn::functional;

const std::vector<test::ConvCase>& mma_cases() {
  static const std::vector<test::ConvCase> cases{
      {4, 16, 12, 16, 160, 3, 1, 1, 1},  // Wide ResNet's first block, small
      {3, 16, 16, 32, 64, 3, 1, 1, 1},   // WRN-16-4's
      {2, 32, 8, 16, 96, 1, 1, 0, 1},    // 1x1, 32 channels
      {2, 16, 8, 16, 128, 5, 1, 2, 1},   // 5x5 (the filter fills 100 KB)
      {5, 16, 10, 18, 32, 3, 1, 0, 1},   // no padding (8x16 out), 128-pixel tiles of 8 rows
      {2, 160, 8, 16, 16, 3, 1, 1, 1},   // 160 -> 16: the reduction over 160, ten steps a tile
      {3, 64, 8, 16, 16, 1, 1, 0, 1},    // 64 -> 16, 1x1
      {2, 16, 4, 64, 160, 3, 1, 1, 1},   // 64 wide: one row a tile
      {16, 16, 32, 32, 160, 3, 1, 1, 1}, // Wide ResNet's first block itself at batch 16
      {16, 16, 32, 32, 160, 1, 1, 0, 1}, // and its 1x1 shortcut
  };
  return cases;
}

// A tensor of `sizes`, channels-last, at 8 bytes past a 16-byte boundary,
// holding noise.
Tensor misaligned_channels_last(const std::vector<int64_t>& sizes, const Device& d, DType dt) {
  const int64_t n = sizes[0], c = sizes[1], h = sizes[2], w = sizes[3];
  const Tensor base = randn({n * c * h * w + 4}).to(d).to(dt);
  return detail::make_view(base, sizes, {h * w * c, 1, w * c, c}, 4);
}

TEST(ConvMma, MatchesTheCpuConvolution_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const Device gpu = cuda_device(0);
  for (DType dt : {kBFloat16, kFloat16})
    for (const test::ConvCase& c : mma_cases()) {
      const std::string what = c.name(dt);
      manual_seed(static_cast<uint64_t>(c.c * 7 + c.kernel * 3 + c.k));
      const F::Conv2dParams p = c.params();
      const Conv2dGeometry g = c.geometry();
      ASSERT_TRUE(cuda::conv_mma_applies(g, cuda::Layout::NHWC, dt)) << what;
      // Values exact in the dtype, so both sides see the same inputs.
      const Tensor x = randn({c.n, c.c, c.h, c.w}).to(dt).to(kFloat32);
      const Tensor w = randn({c.k, c.c, c.kernel, c.kernel}).mul(0.1).to(dt).to(kFloat32);
      const Tensor ref_y = F::conv2d(x, w, Tensor(), p);
      const Tensor gx = test::channels_last_on(x, gpu, dt), gw = test::channels_last_on(w, gpu, dt);
      // One rounding of the float sum (2^-8 relative for bf16).
      const double tol = dt == kBFloat16 ? 1e-2 : 2e-3;
      // Outputs start as noise: every element must be written.
      const Tensor y = test::channels_last_on(randn(ref_y.sizes()), gpu, dt);
      cuda::conv_mma_forward(g, gx, gw, y);
      EXPECT_LT(test::rel_err(y, ref_y), tol) << what;
      const Tensor y8 = misaligned_channels_last(ref_y.sizes(), gpu, dt);
      ASSERT_TRUE(cuda::conv_mma_aligned(gx, gw, y8));
      cuda::conv_mma_forward(g, gx, gw, y8);
      EXPECT_LT(test::rel_err(y8, ref_y), tol) << what << ", output 8 bytes off 16";
      EXPECT_EQ(test::rel_err(y8, y), 0.0) << what << ": the same bits wherever the output is";
    }
}

TEST(ConvMma, OpsWithThePathAgreeWithCudnn_CUDA) {
  // Through the op: with the path allowed each geometry is timed against
  // cuDNN and runs the faster; off, cuDNN runs. Both agree to the dtype's
  // rounding, and the path is refused for what it cannot do.
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const Device gpu = cuda_device(0);
  struct Restore {
    ~Restore() { cuda::set_conv_mma_enabled(true); }
  } restore;
  const test::ConvCase c{32, 16, 32, 32, 160, 3, 1, 1, 1};
  const F::Conv2dParams p = c.params();
  manual_seed(9);
  const Tensor x = test::channels_last_on(randn({c.n, c.c, c.h, c.w}), gpu, kBFloat16);
  const Tensor w = test::channels_last_on(randn({c.k, c.c, 3, 3}).mul(0.1), gpu, kBFloat16);
  std::vector<Tensor> got(2);
  int64_t runs[2];
  for (int on = 0; on < 2; ++on) {
    cuda::set_conv_mma_enabled(on == 1);
    const int64_t before = cuda::conv_mma_runs();
    got[on] = F::conv2d(x, w, Tensor(), p);
    runs[on] = cuda::conv_mma_runs() - before;
  }
  // Off, the op never reaches the kernel; on, it is at least timed (and runs
  // from then on when it won).
  EXPECT_EQ(runs[0], 0);
  EXPECT_GE(runs[1], 1);
  EXPECT_LT(test::rel_err(got[1], got[0]), 1e-2);
  // What the path leaves to cuDNN: NCHW, float32, grouped, strided, dilated,
  // input channels not a multiple of 16, outputs it has no tile for, both
  // sides wide, rows it cannot tile.
  const Conv2dGeometry g = c.geometry();
  EXPECT_TRUE(cuda::conv_mma_applies(g, cuda::Layout::NHWC, kBFloat16));
  EXPECT_TRUE(cuda::conv_mma_applies(g, cuda::Layout::NHWC, kFloat16));
  EXPECT_FALSE(cuda::conv_mma_applies(g, cuda::Layout::NCHW, kBFloat16));
  EXPECT_FALSE(cuda::conv_mma_applies(g, cuda::Layout::NHWC, kFloat32));
  Conv2dGeometry grouped = g, strided = g, dilated = g, eight = g, odd_out = g, wide = g, narrow = g, short_rows = g;
  grouped.groups = 2;
  strided.stride_h = 2;
  dilated.dil_w = 2;
  eight.c_in = 8;
  odd_out.c_out = 48;
  wide.c_in = 64;
  wide.c_out = 64;
  narrow.w = 20;     // rows not a multiple of 16 pixels
  short_rows.h = 3;  // 3 rows do not make whole 2-row tiles
  for (const Conv2dGeometry& refused : {grouped, strided, dilated, eight, odd_out, wide, narrow, short_rows})
    EXPECT_FALSE(cuda::conv_mma_applies(refused, cuda::Layout::NHWC, kBFloat16));
}

}  // namespace
}  // namespace chorus

#endif  // CHORUS_WITH_CUDA
