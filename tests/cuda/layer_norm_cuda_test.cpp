// Layer norm's forward kernels on the GPU (cuda/kernels/layer_norm_forward.cu), alone
// and beside the residual add, against the CPU's on the same rounded inputs:
// widths that reach every K instance of the register kernels (Note [Layer
// norm's forward from registers]), in 16-byte vectors and element by element,
// and the loop kernels past them, a warp a row and a block a row; rows that
// are no multiple of a block's; float32 and bfloat16; no parameters, float32
// master parameters, and parameters in x's dtype. Only the ops' API: it
// compiles in a CPU build too, and skips there.
#include <gtest/gtest.h>

#include <cmath>
#include <tuple>
#include <vector>

#include <chorus/chorus.h>
#include <chorus/ops/transformer.h>

#include "testing/gradcheck.h"

namespace chorus {
namespace {
// Named: unity builds put this file beside others with helpers of the same names.
namespace layer_norm_cuda_test {

using test::random_leaf_in;

std::vector<double> doubles(const Tensor& t) { return t.to(cpu_device(0), kFloat64).contiguous().to_vector<double>(); }

// Each element of got within rel * |want| + abs of want's.
void expect_close(const Tensor& got, const Tensor& want, double rel, double abs, const char* what) {
  const std::vector<double> g = doubles(got), w = doubles(want);
  ASSERT_EQ(g.size(), w.size()) << what;
  for (size_t i = 0; i < w.size(); ++i)
    ASSERT_NEAR(g[i], w[i], rel * std::abs(w[i]) + abs) << what << " element " << i;
}

enum class Params { None, Float32, XDtype };

// Which register kernel a width takes (cols / V vectors, V = 16 bytes of T
// where cols allows, else 1; K = 1, 2, 3, 4 or 8 vectors a lane), or the
// loop kernels past 8 * 32 vectors:
//   bf16:    8, 64, 200 -> K 1 (V 8); 100 -> K 4 (V 1); 250 -> K 8 (V 1);
//            512 -> K 2; 768 -> K 3; 1024 -> K 4; 1600 -> K 8; 771 -> loop,
//            warp a row; 3000 -> loop, block a row.
//   float32: 8, 64, 100 -> K 1 (V 4); 200 -> K 2; 512 -> K 4; 768, 1024
//            -> K 8; 250 -> K 8 (V 1); 771 -> loop, warp a row; 1600, 3000
//            -> loop, block a row.
const std::vector<int64_t> kWidths{8, 64, 100, 200, 250, 512, 768, 771, 1024, 1600, 3000};

TEST(LayerNormForward, MatchesTheCpuAtEveryWidth_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const Device gpu("cuda:0");
  const double eps = 1e-5;
  for (DType dt : {kFloat32, kBFloat16}) {
    // bf16 outputs may round the other way from the CPU's (float sums in
    // another order): one ulp, 2^-7 of the value; float32 within its sums' error.
    const double rel = dt == kBFloat16 ? 1.0 / 128 : 2e-5, abs = dt == kBFloat16 ? 1e-5 : 2e-5;
    for (int64_t rows : {int64_t{1}, int64_t{37}}) {
      for (size_t wi = 0; wi < kWidths.size(); ++wi) {
        const int64_t cols = kWidths[wi];
        const uint64_t seed = 300 + 16 * wi + rows;
        // Rows with a mean away from zero (x + r in [-1.5, 4.5]).
        const Tensor x = random_leaf_in({rows, cols}, seed, -1.0, 3.0).detach().to(dt);
        const Tensor r = random_leaf_in({rows, cols}, seed + 1, -0.5, 1.5).detach().to(dt);
        const Tensor w32 = random_leaf_in({cols}, seed + 2, 0.5, 1.5).detach().to(kFloat32);
        const Tensor b32 = random_leaf_in({cols}, seed + 3, -0.5, 0.5).detach().to(kFloat32);
        for (Params p : {Params::None, Params::Float32, Params::XDtype}) {
          if (p == Params::XDtype && dt == kFloat32) continue;  // Float32's case
          SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " " << rows << " x " << cols << " params "
                                            << static_cast<int>(p));
          const DType pdt = p == Params::XDtype ? dt : kFloat32;
          const Tensor w = p == Params::None ? Tensor() : w32.to(pdt);
          const Tensor b = p == Params::None ? Tensor() : b32.to(pdt);
          auto on_gpu = [&](const Tensor& t) { return t.defined() ? t.to(gpu).contiguous() : Tensor(); };

          auto [yc, mc, rc] = ops::layer_norm(x, w, b, eps);
          auto [yg, mg, rg] = ops::layer_norm(on_gpu(x), on_gpu(w), on_gpu(b), eps);
          ASSERT_TRUE(yg.device().is_cuda());
          EXPECT_EQ(yg.dtype(), dt);
          expect_close(yg, yc, rel, abs, "y");
          expect_close(mg, mc, 1e-5, 1e-6, "mean");
          expect_close(rg, rc, 1e-5, 1e-6, "rstd");

          auto [sc, y2c, m2c, r2c] = ops::add_layer_norm(x, r, w, b, eps);
          auto [sg, y2g, m2g, r2g] = ops::add_layer_norm(on_gpu(x), on_gpu(r), on_gpu(w), on_gpu(b), eps);
          EXPECT_EQ(sg.dtype(), dt);
          EXPECT_EQ(y2g.dtype(), dt);
          // One add rounded once to dt on either device.
          expect_close(sg, sc, 0.0, 0.0, "sum");
          expect_close(y2g, y2c, rel, abs, "add's y");
          expect_close(m2g, m2c, 1e-5, 1e-6, "add's mean");
          expect_close(r2g, r2c, 1e-5, 1e-6, "add's rstd");
          // The fused op is add then layer_norm (Note [Residual add beside
          // layer norm]); on the GPU the same kernels' sums, bit for bit.
          auto [y3g, m3g, r3g] = ops::layer_norm(sg, on_gpu(w), on_gpu(b), eps);
          expect_close(y2g, y3g, 0.0, 0.0, "add's y against layer_norm of the sum");
          expect_close(m2g, m3g, 0.0, 0.0, "add's mean against layer_norm of the sum");
          expect_close(r2g, r3g, 0.0, 0.0, "add's rstd against layer_norm of the sum");
        }
      }
    }
  }
}

}  // namespace layer_norm_cuda_test
}  // namespace
}  // namespace chorus
