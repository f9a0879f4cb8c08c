// The transformer's CUDA kernels against the CPU in float32 and bfloat16 on
// the same rounded inputs: layer norm, GELU, attention and the fused
// classifier; add_layer_norm; layer norm's backward over many rows; the fused
// (cuDNN flash) attention against the composite; linear layers with a bias,
// their float32 weight gradients from 16-bit data, and the one-op GPT MLP. The
// CPU's own ops are checked against float64 references in
// tests/nn/transformer_ops_test.cpp.
//
// Not behind CHORUS_WITH_CUDA: the _CUDA tests skip, visibly, without a
// device, and LinearGradientsInFloat32From16BitData checks the CPU as well.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include <chorus/autograd/engine.h>
#include <chorus/chorus.h>
#include <chorus/ops/linear.h>

#include "nn/transformer_test_util.h"
#include "testing/expect_error.h"
#include "testing/gradcheck.h"

namespace chorus {
namespace {

using test::ids;
using test::max_abs_diff;
using test::random_leaf;
namespace F = nn::functional;

// A fresh leaf holding t's values rounded to `dt`, on `d`; on the CPU kept in
// float32 (the reference computes in float on the same rounded inputs).
Tensor leaf(const Tensor& t, Device d, DType dt, bool as_float = true) {
  Tensor v = t.detach().to(dt);
  if (as_float) v = v.to(kFloat32);
  return v.to(d).detach().clone().set_requires_grad(true);
}

struct DeviceCase {
  DType dtype;
  double tol;
};

TEST(TransformerOps, KernelsMatchTheCpu_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const Device gpu("cuda:0");
  for (DeviceCase dc : {DeviceCase{kFloat32, 2e-5}, DeviceCase{kBFloat16, 3e-2}}) {
    SCOPED_TRACE(dtype_name(dc.dtype));
    // Rows short (warp per row) and long (block per row).
    for (int64_t cols : {64, 1600}) {
      Tensor x = random_leaf({37, cols}, 30).mul(2.0).detach().to(kFloat32);
      Tensor w = random_leaf({cols}, 31).detach().to(kFloat32), b = random_leaf({cols}, 32).detach().to(kFloat32);
      Tensor xc = leaf(x, cpu_device(0), dc.dtype), wc = leaf(w, cpu_device(0), kFloat32),
             bc = leaf(b, cpu_device(0), kFloat32);
      Tensor xg = leaf(x, gpu, dc.dtype, false), wg = leaf(w, gpu, kFloat32, false), bg = leaf(b, gpu, kFloat32, false);
      Tensor gy = random_leaf({37, cols}, 33).detach().to(kFloat32);
      Tensor yc = F::layer_norm(xc, wc, bc), yg = F::layer_norm(xg, wg, bg);
      EXPECT_LT(max_abs_diff(yc, yg), dc.tol * 4) << "layer norm forward, cols " << cols;
      yc.backward(gy.to(dc.dtype).to(kFloat32));
      yg.backward(gy.to(gpu, dc.dtype));
      EXPECT_LT(max_abs_diff(xc.grad(), xg.grad()), dc.tol * 8) << "layer norm dx, cols " << cols;
      EXPECT_LT(max_abs_diff(wc.grad(), wg.grad()), dc.tol * 40) << "layer norm dgamma, cols " << cols;
      EXPECT_LT(max_abs_diff(bc.grad(), bg.grad()), dc.tol * 40) << "layer norm dbeta, cols " << cols;
      EXPECT_EQ(wg.grad().dtype(), kFloat32);
      // GELU, both forms.
      for (bool approx : {false, true}) {
        EXPECT_LT(max_abs_diff(F::gelu(xc.detach(), approx), F::gelu(xg.detach(), approx)), dc.tol * 4);
      }
    }
    // Attention, causal and not, T = 70 (not a multiple of 64), head_dim 64 and 128.
    for (int64_t d : {64, 128}) {
      for (bool causal : {true, false}) {
        Tensor q = random_leaf({2, 3, 70, d}, 40).detach().to(kFloat32), k = random_leaf({2, 3, 70, d}, 41).detach().to(kFloat32),
               v = random_leaf({2, 3, 70, d}, 42).detach().to(kFloat32), go = random_leaf({2, 3, 70, d}, 43).detach().to(kFloat32);
        TensorList cpu_in, gpu_in;
        for (const Tensor& t : {q, k, v}) {
          cpu_in.push_back(leaf(t, cpu_device(0), dc.dtype));
          gpu_in.push_back(leaf(t, gpu, dc.dtype, false));
        }
        Tensor oc = F::scaled_dot_product_attention(cpu_in[0], cpu_in[1], cpu_in[2], causal);
        Tensor og = F::scaled_dot_product_attention(gpu_in[0], gpu_in[1], gpu_in[2], causal);
        EXPECT_LT(max_abs_diff(oc, og), dc.tol * 2) << "attention forward d " << d << " causal " << causal;
        oc.backward(go.to(dc.dtype).to(kFloat32));
        og.backward(go.to(gpu, dc.dtype));
        for (int i = 0; i < 3; ++i)
          EXPECT_LT(max_abs_diff(cpu_in[i].grad(), gpu_in[i].grad()), dc.tol * 8) << "attention grad " << i;
      }
    }
    // The fused classifier over a padded vocabulary, with ignored rows: rows
    // of 300 (not whole 16-byte vectors: element by element on the GPU) and
    // of 512 (8 bf16 at a time, padding columns inside the last vector).
    // bf16 gradients are rounded to 8 bits (half an ulp of the largest, 1/rows)
    // before the mean's scale rounds them again.
    auto classifier = [&](int64_t rows, int64_t cols, int64_t valid, uint64_t seed, int64_t every, int64_t mult,
                          double bf16_tol) {
      SCOPED_TRACE(::testing::Message() << "classifier " << rows << " x " << cols);
      Tensor logits = random_leaf({rows, cols}, seed).mul(4.0).detach().to(kFloat32);
      std::vector<int64_t> tv;
      for (int64_t r = 0; r < rows; ++r) tv.push_back(r % every == 0 ? -1 : (r * mult) % valid);
      Tensor t = ids(tv, {rows});
      Tensor lc = leaf(logits, cpu_device(0), dc.dtype), lg = leaf(logits, gpu, dc.dtype, false);
      Tensor cc = F::cross_entropy_fused(lc, t, valid, -1), cg = F::cross_entropy_fused(lg, t.to(gpu), valid, -1);
      EXPECT_NEAR(cc.item(), cg.item(), 1e-4);
      cc.backward();
      cg.backward();
      EXPECT_LT(max_abs_diff(lc.grad(), lg.grad()), dc.dtype == kFloat32 ? 1e-6 : bf16_tol);
    };
    classifier(29, 300, 257, 50, 5, 37, 2e-4);
    classifier(33, 512, 500, 51, 7, 131, 4e-4);
    // A GPT's padded vocabulary, and 16384 columns.
    classifier(6, 50304, 50257, 52, 4, 7919, 1e-3);
    classifier(5, 16384, 16000, 53, 3, 4099, 1e-3);
  }
}

// add_layer_norm on the GPU (one forward kernel; the norm's backward kernel
// adding the residual's gradient) against the CPU in float32 and bfloat16:
// rows short (warp per row) and long (block per row), and of 771 columns
// (no 16-byte vectors), float32 parameters beside 16-bit activations.
TEST(TransformerOps, AddLayerNormMatchesTheCpu_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const Device gpu("cuda:0");
  for (DeviceCase dc : {DeviceCase{kFloat32, 2e-5}, DeviceCase{kBFloat16, 3e-2}}) {
    SCOPED_TRACE(dtype_name(dc.dtype));
    for (int64_t cols : {64, 771, 1600}) {
      SCOPED_TRACE(::testing::Message() << "cols " << cols);
      Tensor x = random_leaf({37, cols}, 70).mul(2.0).detach().to(kFloat32);
      Tensor r = random_leaf({37, cols}, 71).detach().to(kFloat32);
      Tensor w = random_leaf({cols}, 72).detach().to(kFloat32), b = random_leaf({cols}, 73).detach().to(kFloat32);
      Tensor gs = random_leaf({37, cols}, 74).detach().to(kFloat32), gy = random_leaf({37, cols}, 75).detach().to(kFloat32);
      Tensor xc = leaf(x, cpu_device(0), dc.dtype), rc = leaf(r, cpu_device(0), dc.dtype),
             wc = leaf(w, cpu_device(0), kFloat32), bc = leaf(b, cpu_device(0), kFloat32);
      Tensor xg = leaf(x, gpu, dc.dtype, false), rg = leaf(r, gpu, dc.dtype, false), wg = leaf(w, gpu, kFloat32, false),
             bg = leaf(b, gpu, kFloat32, false);
      auto [sc, yc] = F::add_layer_norm(xc, rc, wc, bc);
      auto [sg, yg] = F::add_layer_norm(xg, rg, wg, bg);
      EXPECT_EQ(sg.dtype(), dc.dtype);
      EXPECT_EQ(yg.dtype(), dc.dtype);
      EXPECT_LT(max_abs_diff(sc, sg), dc.tol * 4) << "sum";
      EXPECT_LT(max_abs_diff(yc, yg), dc.tol * 4) << "normed";
      autograd::run_backward({sc, yc}, {gs.to(dc.dtype).to(kFloat32), gy.to(dc.dtype).to(kFloat32)}, false);
      autograd::run_backward({sg, yg}, {gs.to(gpu, dc.dtype), gy.to(gpu, dc.dtype)}, false);
      EXPECT_LT(max_abs_diff(xc.grad(), xg.grad()), dc.tol * 8) << "dx";
      EXPECT_LT(max_abs_diff(rc.grad(), rg.grad()), dc.tol * 8) << "dr";
      EXPECT_LT(max_abs_diff(wc.grad(), wg.grad()), dc.tol * 40) << "dgamma";
      EXPECT_LT(max_abs_diff(bc.grad(), bg.grad()), dc.tol * 40) << "dbeta";
      EXPECT_EQ(wg.grad().dtype(), kFloat32);
      // On the GPU the fused op equals add then layer_norm: the norm reads
      // the sum rounded to its dtype, and dx + d(sum) is rounded as their add
      // would be (up to the order of float sums in the rows' reductions).
      Tensor xg2 = leaf(x, gpu, dc.dtype, false), rg2 = leaf(r, gpu, dc.dtype, false);
      Tensor s2 = chorus::add(xg2, rg2), y2 = F::layer_norm(s2, wg.detach(), bg.detach());
      EXPECT_EQ(max_abs_diff(sg, s2), 0.0);
      EXPECT_LT(max_abs_diff(yg, y2), dc.dtype == kFloat32 ? 1e-5 : 2e-2);
      autograd::run_backward({s2, y2}, {gs.to(gpu, dc.dtype), gy.to(gpu, dc.dtype)}, false);
      EXPECT_LT(max_abs_diff(xg.grad(), xg2.grad()), dc.dtype == kFloat32 ? 1e-5 : 3e-2);
    }
  }
}

// Layer norm's backward on the GPU (Note [Layer norm's backward in one pass]
// in cuda/kernels/layer_norm_backward.cu) over enough rows that the bounded grid
// strides: more rows than a full H200 holds at once (9000 > 8 rows x 8
// blocks x 132 SMs with a warp per row; 4500 > 32 blocks x 132 SMs with a
// block of 64 threads per row) and rows not a multiple of anything, so that
// every block sums several rows and the blocks' partial sums are added. Short
// and long rows, 16-byte vectors and not (771, 1601 columns), 8192 columns
// (the fused path's widest) and 8200 (the two-kernel path), and for the
// warp-a-row kernel (Note [Layer norm's backward, sums in shared memory])
// every count of vectors a lane owns (128, 200, 512, 768 and 1024 columns:
// 1, 1, 2, 3 and 4 16-bit vectors; 1, 2, 4, 6 and 8 float32 ones), against
// the CPU in float64 on the same rounded inputs, in float32, bfloat16 and
// float16. Each shape runs with float32 gamma and beta and with one of (rows
// of up to 1024 columns: with each of) the residual's gradient added
// (add_layer_norm), gamma alone in x's dtype (no dbeta), beta alone (no
// gamma, no dgamma).
TEST(TransformerOps, LayerNormBackwardOverManyRowsMatchesTheCpu_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const Device gpu("cuda:0");
  struct RowsCols {
    int64_t rows, cols;
  };
  const std::vector<RowsCols> shapes{{9000, 768}, {3000, 771},  {4500, 1600}, {517, 1601}, {300, 8192},
                                     {40, 8200},  {5000, 1024}, {2500, 200},  {3000, 512}, {3000, 128}};
  for (DeviceCase dc : {DeviceCase{kFloat32, 2e-5}, DeviceCase{kBFloat16, 3e-2}, DeviceCase{kFloat16, 4e-3}}) {
    SCOPED_TRACE(dtype_name(dc.dtype));
    for (size_t i = 0; i < shapes.size(); ++i) {
      const int64_t rows = shapes[i].rows, cols = shapes[i].cols;
      const uint64_t seed = 80 + 10 * i;
      Tensor x = random_leaf({rows, cols}, seed).mul(2.0).detach();
      Tensor r = random_leaf({rows, cols}, seed + 1).detach();
      Tensor w = random_leaf({cols}, seed + 2).detach().to(kFloat32);
      Tensor b = random_leaf({cols}, seed + 3).detach().to(kFloat32);
      Tensor gy = random_leaf({rows, cols}, seed + 4).detach(), gs = random_leaf({rows, cols}, seed + 5).detach();
      // Leaves rounded to dt: on the CPU held in float64, on the GPU in dt.
      auto cpu = [&](const Tensor& t, DType dt) {
        return t.to(dt).to(kFloat64).detach().clone().set_requires_grad(true);
      };
      // (Rounded on the host first: a CUDA tensor cannot be float64.)
      auto dev = [&](const Tensor& t, DType dt) { return t.to(dt).to(gpu).detach().clone().set_requires_grad(true); };
      const std::vector<int> variants =
          cols <= 1024 ? std::vector<int>{0, 1, 2, 3} : std::vector<int>{0, 1 + static_cast<int>(i % 3)};
      for (int variant : variants) {
        SCOPED_TRACE(::testing::Message() << rows << " x " << cols << " variant " << variant);
        const bool with_w = variant != 3, with_b = variant != 2;
        // The parameters in x's dtype alone, or float32 master weights.
        const DType wdt = variant == 2 ? dc.dtype : kFloat32, bdt = variant == 3 ? dc.dtype : kFloat32;
        Tensor xc = cpu(x, dc.dtype), xg = dev(x, dc.dtype), rc = cpu(r, dc.dtype), rg = dev(r, dc.dtype);
        Tensor wc = with_w ? cpu(w, wdt) : Tensor(), wg = with_w ? dev(w, wdt) : Tensor();
        Tensor bc = with_b ? cpu(b, bdt) : Tensor(), bg = with_b ? dev(b, bdt) : Tensor();
        if (variant == 1) {
          auto [sc, yc] = F::add_layer_norm(xc, rc, wc, bc);
          auto [sg, yg] = F::add_layer_norm(xg, rg, wg, bg);
          autograd::run_backward({sc, yc}, {gs.to(dc.dtype).to(kFloat64), gy.to(dc.dtype).to(kFloat64)}, false);
          autograd::run_backward({sg, yg}, {gs.to(dc.dtype).to(gpu), gy.to(dc.dtype).to(gpu)}, false);
          EXPECT_LT(max_abs_diff(rc.grad(), rg.grad()), dc.tol * 8) << "dr";
        } else {
          Tensor yc = F::layer_norm(xc, wc, bc), yg = F::layer_norm(xg, wg, bg);
          yc.backward(gy.to(dc.dtype).to(kFloat64));
          yg.backward(gy.to(dc.dtype).to(gpu));
        }
        EXPECT_LT(max_abs_diff(xc.grad(), xg.grad()), dc.tol * 8) << "dx";
        // A 16-bit parameter's gradient is the float32 sum rounded once.
        if (with_w) {
          EXPECT_EQ(wg.grad().dtype(), wdt);
          EXPECT_LT(max_abs_diff(wc.grad(), wg.grad()), wdt == kFloat32 ? dc.tol * 40 : 3e-2 * 40) << "dgamma";
        }
        if (with_b) {
          EXPECT_EQ(bg.grad().dtype(), bdt);
          EXPECT_LT(max_abs_diff(bc.grad(), bg.grad()), bdt == kFloat32 ? dc.tol * 40 : 3e-2 * 40) << "dbeta";
        }
        if (variant == 0 && cols <= 8192) {
          // The same bits run to run: the one-pass kernels' sums have fixed
          // orders, no atomics (wider rows' second kernel adds with atomics).
          Tensor xg2 = dev(x, dc.dtype), wg2 = dev(w, wdt), bg2 = dev(b, bdt);
          F::layer_norm(xg2, wg2, bg2).backward(gy.to(dc.dtype).to(gpu));
          EXPECT_EQ(max_abs_diff(xg.grad(), xg2.grad()), 0.0) << "dx run to run";
          EXPECT_EQ(max_abs_diff(wg.grad(), wg2.grad()), 0.0) << "dgamma run to run";
          EXPECT_EQ(max_abs_diff(bg.grad(), bg2.grad()), 0.0) << "dbeta run to run";
        }
      }
    }
  }
}

// The fused (cuDNN flash) attention against the composite path on the GPU,
// both in bfloat16, and both against the composite in float32 on the same
// rounded inputs: q, k, v are the GPT's strided slices of one [B, T, 3C]
// projection. Sequences of 1024 and 1000 (not a multiple of 64), head_dim 64
// and 128, causal and not. The fused path must be at least as close to the
// float32 reference as the bf16 composite (within 1.5x and a small floor),
// and its memory must not grow with T x T.
TEST(TransformerOps, FusedAttentionMatchesComposite_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const Device gpu("cuda:0");
  for (int64_t d : {64, 128}) {
    for (int64_t t : {1024, 1000}) {
      for (bool causal : {true, false}) {
        SCOPED_TRACE(::testing::Message() << "d " << d << " t " << t << " causal " << causal);
        const int64_t b = 2, h = 3, c = h * d;
        Tensor qkv32 = random_leaf({b, t, 3 * c}, 70 + d + t).detach().to(kFloat32).to(gpu);
        Tensor go32 = random_leaf({b, t, c}, 71 + d + t).detach().to(kFloat32).to(gpu);
        auto run = [&](DType dt, ops::AttentionKernel kern, TensorList* grads) {
          Tensor qkv = qkv32.to(kBFloat16).to(dt).detach().clone().set_requires_grad(true);
          TensorList parts = chorus::split(qkv, c, 2);
          for (Tensor& p : parts) p = p.reshape({b, t, h, d}).permute({0, 2, 1, 3});
          Tensor y = F::scaled_dot_product_attention(parts[0], parts[1], parts[2], causal, 0.0, kern);
          Tensor out = y.permute({0, 2, 1, 3}).reshape({b, t, c});
          out.backward(go32.to(kBFloat16).to(dt));
          grads->push_back(qkv.grad());
          return out;
        };
        // GPT's path: one packed QKV, its gradient written in place.
        auto run_packed = [&](DType dt, ops::AttentionKernel kern, TensorList* grads) {
          Tensor qkv = qkv32.to(kBFloat16).to(dt).detach().clone().set_requires_grad(true);
          Tensor out = F::causal_self_attention(qkv, h, 0.0, kern);
          out.backward(go32.to(kBFloat16).to(dt));
          grads->push_back(qkv.grad());
          return out;
        };
        TensorList g_ref, g_comp, g_fused;
        Tensor ref = run(kFloat32, ops::AttentionKernel::Composite, &g_ref);
        // Memory above what is held before each run, at its peak.
        auto peak_of = [&](ops::AttentionKernel kern, TensorList* grads, Tensor* out, bool packed = false) {
          synchronize(gpu);
          backend(gpu).reset_peak_bytes(gpu);
          const size_t before = backend(gpu).bytes_in_use(gpu);
          *out = packed ? run_packed(kBFloat16, kern, grads) : run(kBFloat16, kern, grads);
          synchronize(gpu);
          return backend(gpu).peak_bytes(gpu) - before;
        };
        Tensor comp, fused;
        const size_t comp_peak = peak_of(ops::AttentionKernel::Composite, &g_comp, &comp);
        const size_t peak = peak_of(ops::AttentionKernel::Fused, &g_fused, &fused);
        const double e_comp = max_abs_diff(ref, comp), e_fused = max_abs_diff(ref, fused);
        EXPECT_LT(e_fused, std::max(1.5 * e_comp, 2e-3)) << "forward: fused " << e_fused << ", composite " << e_comp;
        const double g_c = max_abs_diff(g_ref[0], g_comp[0]), g_f = max_abs_diff(g_ref[0], g_fused[0]);
        EXPECT_LT(g_f, std::max(1.5 * g_c, 5e-3)) << "gradient: fused " << g_f << ", composite " << g_c;
        // The fused step holds O(b*h*t*d) bytes (inputs, outputs, gradients,
        // float accumulators; about 40 a head element), the composite its
        // T x T scores and probabilities on top.
        EXPECT_LT(peak, static_cast<size_t>(64 * b * h * t * d)) << "peak " << peak << " bytes";
        EXPECT_LT(peak, comp_peak) << "fused peak " << peak << " bytes, composite " << comp_peak;
        if (causal) {
          TensorList g_packed;
          Tensor packed;
          const size_t packed_peak = peak_of(ops::AttentionKernel::Fused, &g_packed, &packed, true);
          EXPECT_LT(max_abs_diff(fused, packed), 1e-6) << "the packed forward is the same kernel";
          const double g_p = max_abs_diff(g_ref[0], g_packed[0]);
          EXPECT_LT(g_p, std::max(1.5 * g_c, 5e-3)) << "packed gradient " << g_p << ", composite " << g_c;
          EXPECT_LE(packed_peak, peak) << "packed peak " << packed_peak << " bytes, split heads " << peak;
        }
      }
    }
  }
  // Float32 has no fused kernel: asked for, it is refused by name.
  Tensor q = random_leaf({1, 2, 64, 64}, 80).detach().to(kFloat32).to(gpu);
  EXPECT_TRUE(test::throws_naming(
      [&] { F::scaled_dot_product_attention(q, q, q, true, 0.0, ops::AttentionKernel::Fused); }, {"bfloat16"}));
}

// Note [Float weight gradients from 16-bit products]: a linear layer's
// weight and bias gradients asked for in float32 from bfloat16 data, against
// float64 sums of the same bfloat16 values (no rounding to 16 bits left: a
// bfloat16 result would be ~1e-3 off), on the CPU and, with a GPU, on it; the
// same for the GPT MLP's second product and its first bias.
TEST(TransformerOps, LinearGradientsInFloat32From16BitData) {
  std::vector<Device> devices{cpu_device(0)};
  if (cuda_device_count() > 0) devices.push_back(Device("cuda:0"));
  const int64_t rows = 75, in = 48, out = 40;
  const Tensor x = random_leaf({rows, in}, 120).detach().to(kBFloat16);
  const Tensor w = random_leaf({out, in}, 121).detach().to(kBFloat16);
  const Tensor dy = random_leaf({rows, out}, 122).detach().to(kBFloat16);
  const std::vector<double> xv = x.to(kFloat64).to_vector<double>(), dyv = dy.to(kFloat64).to_vector<double>();
  std::vector<double> dw_ref(out * in, 0.0), db_ref(out, 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o) {
      db_ref[o] += dyv[r * out + o];
      for (int64_t i = 0; i < in; ++i) dw_ref[o * in + i] += dyv[r * out + o] * xv[r * in + i];
    }
  auto rel = [](const std::vector<double>& ref, const Tensor& got) {
    const std::vector<double> g = got.to(cpu_device(0), kFloat64).to_vector<double>();
    double m = 0, big = 1e-30;
    for (size_t i = 0; i < ref.size(); ++i) m = std::max(m, std::abs(ref[i] - g[i])), big = std::max(big, std::abs(ref[i]));
    return m / big;
  };
  for (const Device& d : devices) {
    SCOPED_TRACE(d.str());
    auto [dx, dw, db] = ops::linear_bias_backward(dy.to(d), x.to(d), w.to(d), true, true, kFloat32);
    EXPECT_EQ(dx.dtype(), kBFloat16);
    ASSERT_EQ(dw.dtype(), kFloat32);
    ASSERT_EQ(db.dtype(), kFloat32);
    EXPECT_LT(rel(dw_ref, dw), 1e-5) << "dw";
    EXPECT_LT(rel(db_ref, db), 1e-5) << "db";
    // The GPT MLP's second product and GELU's backward with x as GELU's
    // output h and w as w2: dw2 = dy^T h and db2 as above, and db1 the float64
    // column sums of the bfloat16 dpre it returns (Note [GELU's gradient with
    // the bias gradient] on a GPU; the kernel set's sums on the CPU).
    const Tensor pre = random_leaf({rows, in}, 123).detach().to(kBFloat16);
    Tensor db1;
    auto [dpre, dw2, db2] = ops::mlp_gelu_backward_second(dy.to(d), w.to(d), pre.to(d), x.to(d), kFloat32, &db1);
    ASSERT_EQ(dpre.dtype(), kBFloat16);
    ASSERT_EQ(dw2.dtype(), kFloat32);
    ASSERT_EQ(db1.dtype(), kFloat32);
    EXPECT_LT(rel(dw_ref, dw2), 1e-5) << "dw2";
    EXPECT_LT(rel(db_ref, db2), 1e-5) << "db2";
    const std::vector<double> dpv = dpre.to(cpu_device(0), kFloat64).to_vector<double>();
    std::vector<double> db1_ref(in, 0.0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < in; ++i) db1_ref[i] += dpv[r * in + i];
    EXPECT_LT(rel(db1_ref, db1), 1e-5) << "db1";
  }
}

// A linear layer with a bias (the product's epilogue adds it; the weight
// gradient's product sums its gradient) on the GPU against the CPU in float32
// on the same rounded inputs: 2-d and 3-d inputs, the GPT's QKV shape, and a
// shape whose rows are not a multiple of anything.
TEST(TransformerOps, LinearWithBiasMatchesTheCpu_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const Device gpu("cuda:0");
  struct Case {
    Shape x;
    int64_t out;
  };
  for (DeviceCase dc : {DeviceCase{kFloat32, 2e-5}, DeviceCase{kBFloat16, 3e-2}}) {
    for (Case c : {Case{{37, 64}, 96}, Case{{4, 129, 64}, 40}, Case{{2, 256, 768}, 2304}}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dc.dtype) << " x " << shape_str(c.x) << " out " << c.out);
      const int64_t in = c.x.back();
      Tensor x = random_leaf(c.x, 90).detach().to(kFloat32), w = random_leaf({c.out, in}, 91).mul(0.1).detach().to(kFloat32),
             b = random_leaf({c.out}, 92).detach().to(kFloat32);
      Shape ys = c.x;
      ys.back() = c.out;
      Tensor gy = random_leaf(ys, 93).detach().to(kFloat32);
      Tensor xc = leaf(x, cpu_device(0), dc.dtype), wc = leaf(w, cpu_device(0), dc.dtype), bc = leaf(b, cpu_device(0), dc.dtype);
      Tensor xg = leaf(x, gpu, dc.dtype, false), wg = leaf(w, gpu, dc.dtype, false), bg = leaf(b, gpu, dc.dtype, false);
      Tensor yc = F::linear(xc, wc, bc), yg = F::linear(xg, wg, bg);
      // Differences relative to the reference's largest magnitude: float32
      // products (no TF32) agree to rounding; bf16 outputs carry 8 bits.
      const double tol = dc.dtype == kFloat32 ? 1e-5 : 1e-2;
      auto rel = [](const Tensor& ref, const Tensor& got) {
        return max_abs_diff(ref, got) / std::max(1e-30, ref.abs().max().item());
      };
      EXPECT_LT(rel(yc, yg), tol) << "forward";
      yc.backward(gy.to(dc.dtype).to(kFloat32));
      yg.backward(gy.to(gpu, dc.dtype));
      EXPECT_LT(rel(xc.grad(), xg.grad()), tol) << "dx";
      EXPECT_LT(rel(wc.grad(), wg.grad()), tol) << "dw";
      EXPECT_LT(rel(bc.grad(), bg.grad()), tol) << "db";
    }
  }
}

// The one-op GPT MLP (GELU and its derivative in the products' epilogues)
// on the GPU against the CPU's composite in float32 on the same rounded
// inputs: the GPT's shape and a small odd one, float32 and bf16.
TEST(TransformerOps, FusedMlpMatchesTheCpu_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const Device gpu("cuda:0");
  for (DType dt : {kFloat32, kBFloat16}) {
    for (Shape xs : {Shape{3, 37, 40}, Shape{2, 256, 768}}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " x " << shape_str(xs));
      const int64_t c = xs.back(), hid = 4 * c;
      Tensor x = random_leaf(xs, 100).detach().to(kFloat32), w1 = random_leaf({hid, c}, 101).mul(0.1).detach().to(kFloat32),
             b1 = random_leaf({hid}, 102).detach().to(kFloat32), w2 = random_leaf({c, hid}, 103).mul(0.05).detach().to(kFloat32),
             b2 = random_leaf({c}, 104).detach().to(kFloat32), gy = random_leaf(xs, 105).detach().to(kFloat32);
      TensorList cpu, dev;
      for (const Tensor& t : {x, w1, b1, w2, b2}) {
        cpu.push_back(leaf(t, cpu_device(0), dt));
        dev.push_back(leaf(t, gpu, dt, false));
      }
      Tensor yc = F::linear(F::gelu(F::linear(cpu[0], cpu[1], cpu[2]), true), cpu[3], cpu[4]);
      Tensor yg = F::mlp_gelu(dev[0], dev[1], dev[2], dev[3], dev[4]);
      const double tol = dt == kFloat32 ? 2e-5 : 2e-2;
      auto rel = [](const Tensor& ref, const Tensor& got) {
        return max_abs_diff(ref, got) / std::max(1e-30, ref.abs().max().item());
      };
      EXPECT_LT(rel(yc, yg), tol) << "forward";
      yc.backward(gy.to(dt).to(kFloat32));
      yg.backward(gy.to(gpu, dt));
      const char* names[] = {"dx", "dw1", "db1", "dw2", "db2"};
      for (int i = 0; i < 5; ++i) EXPECT_LT(rel(cpu[i].grad(), dev[i].grad()), tol) << names[i];
    }
  }
}

}  // namespace
}  // namespace chorus
