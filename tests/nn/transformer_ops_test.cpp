// The transformer's ops (GELU, layer norm, attention, the fused classifier,
// embedding) on the CPU: gradients against central differences in float64,
// forward values against closed forms computed here in double. The CUDA
// kernels are checked against the CPU in tests/cuda/transformer_ops_cuda_test.cpp.
#include <gtest/gtest.h>

#include <cmath>

#include <chorus/autograd/engine.h>
#include <chorus/chorus.h>

#include "nn/transformer_test_util.h"
#include "testing/expect_error.h"
#include "testing/gradcheck.h"

namespace chorus {
namespace {

using test::gradcheck;
using test::ids;
using test::max_abs_diff;
using test::random_leaf;
using L = const TensorList&;
namespace F = nn::functional;

// ---- GELU --------------------------------------------------------------------------

TEST(TransformerOps, GeluMatchesClosedForms) {
  Tensor x = random_leaf({5, 7}, 3).mul(3.0).detach();
  auto xs = x.to_vector<double>();
  auto exact = F::gelu(x, false).to_vector<double>(), approx = F::gelu(x, true).to_vector<double>();
  for (size_t i = 0; i < xs.size(); ++i) {
    const double v = xs[i];
    EXPECT_NEAR(exact[i], 0.5 * v * (1 + std::erf(v / std::sqrt(2.0))), 1e-14);
    EXPECT_NEAR(approx[i], 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v))), 1e-14);
  }
}

TEST(TransformerOps, GeluGradients) {
  Tensor x = random_leaf({4, 6}, 4);
  EXPECT_TRUE(gradcheck([](L in) { return F::gelu(in[0].mul(2.5), false); }, {x}));
  EXPECT_TRUE(gradcheck([](L in) { return F::gelu(in[0].mul(2.5), true); }, {x}));
}

// ---- layer norm ------------------------------------------------------------------------

TEST(TransformerOps, LayerNormMatchesItsDefinition) {
  const int64_t rows = 6, cols = 10;
  Tensor x = random_leaf({rows, cols}, 5).mul(4.0).add(1.5).detach();
  Tensor w = random_leaf({cols}, 6).detach(), b = random_leaf({cols}, 7).detach();
  auto y = F::layer_norm(x, w, b, 1e-5).to_vector<double>();
  auto xs = x.to_vector<double>(), ws = w.to_vector<double>(), bs = b.to_vector<double>();
  for (int64_t r = 0; r < rows; ++r) {
    double m = 0, v = 0;
    for (int64_t c = 0; c < cols; ++c) m += xs[r * cols + c] / cols;
    for (int64_t c = 0; c < cols; ++c) v += (xs[r * cols + c] - m) * (xs[r * cols + c] - m) / cols;
    for (int64_t c = 0; c < cols; ++c) {
      const double want = (xs[r * cols + c] - m) / std::sqrt(v + 1e-5) * ws[c] + bs[c];
      EXPECT_NEAR(y[r * cols + c], want, 1e-12) << "row " << r << " col " << c;
    }
  }
}

TEST(TransformerOps, LayerNormGradients) {
  Tensor x = random_leaf({2, 3, 8}, 8), w = random_leaf({8}, 9), b = random_leaf({8}, 10);
  EXPECT_TRUE(gradcheck([](L in) { return F::layer_norm(in[0], in[1], in[2], 1e-5); }, {x, w, b}));
  EXPECT_TRUE(gradcheck([](L in) { return F::layer_norm(in[0], Tensor(), Tensor(), 1e-5); }, {x}));
}

TEST(TransformerOps, LayerNormRejectsAWrongWeight) {
  Tensor x = random_leaf({2, 8}, 1).detach();
  EXPECT_TRUE(test::throws_naming([&] { F::layer_norm(x, ones({7}, {kFloat64}), Tensor()); }, {"layer_norm", "[8]"}));
}

// ---- the residual add beside layer norm --------------------------------------------------

// add_layer_norm (Note [Residual add beside layer norm]) against add then
// layer_norm, on the CPU in float64 and float32: the sum and the norm equal,
// and the gradients of x, r, weight and bias from both outputs' gradients
// (d(sum) from the residual path, d(normed) from the next layer) equal the
// composition's -- also with only one of the outputs used.
TEST(TransformerOps, AddLayerNormEqualsTheComposition) {
  for (DType dt : {kFloat64, kFloat32}) {
    SCOPED_TRACE(dtype_name(dt));
    const double tol = dt == kFloat64 ? 1e-14 : 1e-6;
    for (int used : {3, 1, 2}) {  // bit 0: the sum's gradient, bit 1: the norm's
      auto make = [&](uint64_t seed, const Shape& s, double scale) {
        return random_leaf(s, seed).mul(scale).detach().to(dt).set_requires_grad(true);
      };
      Tensor x1 = make(60, {3, 4, 12}, 3.0), r1 = make(61, {3, 4, 12}, 1.0);
      Tensor w1 = make(62, {12}, 1.0), b1 = make(63, {12}, 1.0);
      Tensor x2 = x1.detach().clone().set_requires_grad(true), r2 = r1.detach().clone().set_requires_grad(true);
      Tensor w2 = w1.detach().clone().set_requires_grad(true), b2 = b1.detach().clone().set_requires_grad(true);
      Tensor gs = random_leaf({3, 4, 12}, 64).detach().to(dt), gy = random_leaf({3, 4, 12}, 65).detach().to(dt);
      auto [s1, y1] = F::add_layer_norm(x1, r1, w1, b1, 1e-5);
      Tensor s2 = chorus::add(x2, r2), y2 = F::layer_norm(s2, w2, b2, 1e-5);
      EXPECT_LT(max_abs_diff(s1, s2), tol);
      EXPECT_LT(max_abs_diff(y1, y2), tol);
      TensorList roots1, roots2, grads;
      if (used & 1) {
        roots1.push_back(s1);
        roots2.push_back(s2);
        grads.push_back(gs);
      }
      if (used & 2) {
        roots1.push_back(y1);
        roots2.push_back(y2);
        grads.push_back(gy);
      }
      autograd::run_backward(roots1, grads, false);
      autograd::run_backward(roots2, grads, false);
      EXPECT_LT(max_abs_diff(x1.grad(), x2.grad()), tol) << "used " << used;
      EXPECT_LT(max_abs_diff(r1.grad(), r2.grad()), tol) << "used " << used;
      EXPECT_LT(max_abs_diff(x1.grad(), r1.grad()), tol) << "used " << used;
      if (used & 2) {
        EXPECT_LT(max_abs_diff(w1.grad(), w2.grad()), tol);
        EXPECT_LT(max_abs_diff(b1.grad(), b2.grad()), tol);
      } else {
        EXPECT_FALSE(w1.grad().defined());
      }
    }
  }
}

TEST(TransformerOps, AddLayerNormGradients) {
  Tensor x = random_leaf({2, 3, 8}, 66), r = random_leaf({2, 3, 8}, 67), w = random_leaf({8}, 68),
         b = random_leaf({8}, 69);
  // Both outputs weighted differently, so that a gradient given to the wrong
  // one shows; then each alone.
  EXPECT_TRUE(gradcheck(
      [](L in) {
        auto [s, y] = F::add_layer_norm(in[0], in[1], in[2], in[3], 1e-5);
        return chorus::add(s.mul(0.7), y.mul(y));
      },
      {x, r, w, b}));
  EXPECT_TRUE(gradcheck([](L in) { return F::add_layer_norm(in[0], in[1], in[2], in[3], 1e-5).second; }, {x, r, w, b}));
  EXPECT_TRUE(gradcheck([](L in) { return F::add_layer_norm(in[0], in[1], Tensor(), Tensor(), 1e-5).second; }, {x, r}));
}

TEST(TransformerOps, AddLayerNormRejectsMismatchedAddends) {
  Tensor x = random_leaf({2, 8}, 1).detach();
  EXPECT_TRUE(test::throws_naming([&] { F::add_layer_norm(x, random_leaf({2, 7}, 2).detach(), Tensor(), Tensor()); },
                                  {"add_layer_norm", "[2, 7]"}));
  EXPECT_TRUE(test::throws_naming([&] { F::add_layer_norm(x, x.to(kFloat32), Tensor(), Tensor()); },
                                  {"add_layer_norm", "float32"}));
}

// ---- attention -------------------------------------------------------------------------

// softmax(q k^T / sqrt(d) + mask) v in double, loop by loop.
std::vector<double> attention_reference(const Tensor& q, const Tensor& k, const Tensor& v, bool causal) {
  const int64_t bh = q.size(0) * q.size(1), t = q.size(2), s = k.size(2), d = q.size(3);
  auto qs = q.contiguous().to_vector<double>(), ks = k.contiguous().to_vector<double>(),
       vs = v.contiguous().to_vector<double>();
  std::vector<double> out(bh * t * d, 0.0);
  for (int64_t h = 0; h < bh; ++h) {
    for (int64_t i = 0; i < t; ++i) {
      const int64_t visible = causal ? i + (s - t) + 1 : s;
      std::vector<double> p(visible);
      double m = -1e300, sum = 0;
      for (int64_t j = 0; j < visible; ++j) {
        double dot = 0;
        for (int64_t e = 0; e < d; ++e) dot += qs[(h * t + i) * d + e] * ks[(h * s + j) * d + e];
        p[j] = dot / std::sqrt(static_cast<double>(d));
        m = std::max(m, p[j]);
      }
      for (int64_t j = 0; j < visible; ++j) sum += (p[j] = std::exp(p[j] - m));
      for (int64_t j = 0; j < visible; ++j) {
        for (int64_t e = 0; e < d; ++e) out[(h * t + i) * d + e] += p[j] / sum * vs[(h * s + j) * d + e];
      }
    }
  }
  return out;
}

TEST(TransformerOps, AttentionMatchesItsDefinition) {
  for (bool causal : {true, false}) {
    for (int64_t s : {5, 7}) {  // S > T: the last T keys line up with the queries
      Tensor q = random_leaf({2, 3, 5, 4}, 11).detach(), k = random_leaf({2, 3, s, 4}, 12).mul(2.0).detach(),
             v = random_leaf({2, 3, s, 4}, 13).detach();
      auto got = F::scaled_dot_product_attention(q, k, v, causal).to_vector<double>();
      auto want = attention_reference(q, k, v, causal);
      for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-13) << "causal " << causal << " at " << i;
    }
  }
}

TEST(TransformerOps, AttentionGradients) {
  Tensor q = random_leaf({1, 2, 5, 3}, 14), k = random_leaf({1, 2, 5, 3}, 15), v = random_leaf({1, 2, 5, 3}, 16);
  EXPECT_TRUE(gradcheck([](L in) { return F::scaled_dot_product_attention(in[0], in[1], in[2], true); }, {q, k, v}));
  Tensor k2 = random_leaf({1, 2, 7, 3}, 17), v2 = random_leaf({1, 2, 7, 3}, 18);
  EXPECT_TRUE(gradcheck([](L in) { return F::scaled_dot_product_attention(in[0], in[1], in[2], false); }, {q, k2, v2}));
  EXPECT_TRUE(gradcheck([](L in) { return F::scaled_dot_product_attention(in[0], in[1], in[2], true); }, {q, k2, v2}));
}

// GPT's attention over its packed QKV projection: the same values and
// gradients as splitting it into heads by hand, one gradient tensor written
// in place (Note [One gradient for packed q, k, v]).
TEST(TransformerOps, PackedAttentionMatchesSplitHeads) {
  const int64_t b = 2, t = 5, h = 2, d = 3, c = h * d;
  Tensor qkv = random_leaf({b, t, 3 * c}, 90);
  Tensor go = random_leaf({b, t, c}, 91).detach();
  auto split_heads = [&](const Tensor& x) {
    TensorList parts = chorus::split(x, c, 2);
    for (Tensor& p : parts) p = p.reshape({b, t, h, d}).permute({0, 2, 1, 3});
    return F::scaled_dot_product_attention(parts[0], parts[1], parts[2], true).permute({0, 2, 1, 3}).reshape({b, t, c});
  };
  Tensor x1 = qkv.detach().clone().set_requires_grad(true), x2 = qkv.detach().clone().set_requires_grad(true);
  Tensor want = split_heads(x1), got = F::causal_self_attention(x2, h);
  EXPECT_EQ(got.sizes(), (Shape{b, t, c}));
  EXPECT_LT(max_abs_diff(want, got), 1e-14);
  want.backward(go);
  got.backward(go);
  EXPECT_LT(max_abs_diff(x1.grad(), x2.grad()), 1e-14);
  EXPECT_TRUE(gradcheck([h](L in) { return F::causal_self_attention(in[0], h); }, {qkv}));
  // With dropout on the probabilities: the same mask from the same seed.
  manual_seed(5);
  Tensor a = split_heads(x1.detach()).detach();
  Tensor xd = x1.detach();
  TensorList parts = chorus::split(xd, c, 2);
  for (Tensor& p : parts) p = p.reshape({b, t, h, d}).permute({0, 2, 1, 3});
  manual_seed(5);
  Tensor with_drop = F::scaled_dot_product_attention(parts[0], parts[1], parts[2], true, 0.3).permute({0, 2, 1, 3}).reshape({b, t, c});
  manual_seed(5);
  Tensor packed_drop = F::causal_self_attention(xd, h, 0.3);
  EXPECT_LT(max_abs_diff(with_drop, packed_drop), 1e-14);
  EXPECT_GT(max_abs_diff(a, packed_drop), 1e-3);  // the mask did something
  EXPECT_TRUE(test::throws_naming([&] { F::causal_self_attention(random_leaf({2, 5, 10}, 92), 2); }, {"3 x heads"}));
}

TEST(TransformerOps, AttentionDropoutIsDeterministicUnderASeedAndDifferentiable) {
  Tensor q = random_leaf({1, 2, 5, 3}, 24), k = random_leaf({1, 2, 5, 3}, 25), v = random_leaf({1, 2, 5, 3}, 26);
  // The same mask at every evaluation: reseeded inside f.
  EXPECT_TRUE(gradcheck(
      [](L in) {
        manual_seed(5);
        return F::scaled_dot_product_attention(in[0], in[1], in[2], true, 0.3);
      },
      {q, k, v}));
  manual_seed(7);
  auto a = F::scaled_dot_product_attention(q, k, v, true, 0.3).to_vector<double>();
  manual_seed(7);
  auto b = F::scaled_dot_product_attention(q, k, v, true, 0.3).to_vector<double>();
  auto plain = F::scaled_dot_product_attention(q, k, v, true).to_vector<double>();
  EXPECT_EQ(a, b);
  EXPECT_NE(a, plain);
}

TEST(TransformerOps, AttentionRejectsMismatchedShapes) {
  Tensor q = random_leaf({1, 2, 5, 3}, 1).detach(), k = random_leaf({1, 2, 4, 3}, 2).detach();
  EXPECT_TRUE(test::throws_naming([&] { F::scaled_dot_product_attention(q, k, k, true); }, {"causal", "keys"}));
  Tensor k3 = random_leaf({1, 3, 5, 3}, 2).detach();
  EXPECT_TRUE(test::throws_naming([&] { F::scaled_dot_product_attention(q, k3, k3, false); }, {"attention"}));
}

// ---- the fused classifier -------------------------------------------------------------------

// Mean over counted rows of logsumexp(x[:valid]) - x[target], in double.
double cross_entropy_reference(const Tensor& logits, const std::vector<int64_t>& target, int64_t valid,
                               int64_t ignore) {
  const int64_t v = logits.size(-1);
  auto xs = logits.contiguous().to_vector<double>();
  double total = 0;
  int64_t count = 0;
  for (size_t r = 0; r < target.size(); ++r) {
    if (target[r] == ignore) continue;
    double m = -1e300, sum = 0;
    for (int64_t c = 0; c < valid; ++c) m = std::max(m, xs[r * v + c]);
    for (int64_t c = 0; c < valid; ++c) sum += std::exp(xs[r * v + c] - m);
    total += m + std::log(sum) - xs[r * v + target[r]];
    ++count;
  }
  return count ? total / count : 0.0;
}

TEST(TransformerOps, AttentionKernelChoice) {
  Tensor q = random_leaf({2, 2, 5, 8}, 60).detach(), k = random_leaf({2, 2, 5, 8}, 61).detach(),
         v = random_leaf({2, 2, 5, 8}, 62).detach();
  // The CPU has no fused kernel: auto is the composite, bit for bit; asking
  // for the fused kernel is an error that says why.
  auto a = F::scaled_dot_product_attention(q, k, v, true, 0.0, ops::AttentionKernel::Auto).to_vector<double>();
  auto c = F::scaled_dot_product_attention(q, k, v, true, 0.0, ops::AttentionKernel::Composite).to_vector<double>();
  EXPECT_EQ(a, c);
  EXPECT_TRUE(test::throws_naming(
      [&] { F::scaled_dot_product_attention(q, k, v, true, 0.0, ops::AttentionKernel::Fused); }, {"attention", "CUDA"}));
  EXPECT_EQ(ops::parse_attention_kernel("fused"), ops::AttentionKernel::Fused);
  EXPECT_TRUE(test::throws_naming([] { ops::parse_attention_kernel("flash2"); }, {"flash2", "auto", "composite"}));
}

TEST(TransformerOps, FusedMlpMatchesItsParts) {
  // The one-op MLP against linear -> gelu(tanh) -> linear, and its gradients
  // against central differences in float64.
  Tensor x = random_leaf({2, 3, 6}, 63), w1 = random_leaf({10, 6}, 64), b1 = random_leaf({10}, 65),
         w2 = random_leaf({6, 10}, 66), b2 = random_leaf({6}, 67);
  auto fused = F::mlp_gelu(x, w1, b1, w2, b2).to_vector<double>();
  auto parts = F::linear(F::gelu(F::linear(x, w1, b1), true), w2, b2).to_vector<double>();
  ASSERT_EQ(fused.size(), parts.size());
  for (size_t i = 0; i < fused.size(); ++i) EXPECT_NEAR(fused[i], parts[i], 1e-12);
  EXPECT_TRUE(gradcheck([](L in) { return F::mlp_gelu(in[0], in[1], in[2], in[3], in[4]); }, {x, w1, b1, w2, b2}));
  EXPECT_TRUE(test::throws_naming([&] { F::mlp_gelu(x, w1, b1, w1, b2); }, {"mlp_gelu", "w2"}));
}

TEST(TransformerOps, FusedCrossEntropyMatchesItsDefinition) {
  Tensor x = random_leaf({2, 3, 9}, 20).mul(5.0).detach();
  std::vector<int64_t> t{0, 6, 3, 6, 1, 2};
  EXPECT_NEAR(F::cross_entropy_fused(x, ids(t, {2, 3})).item(), cross_entropy_reference(x, t, 9, -100), 1e-13);
  EXPECT_NEAR(F::cross_entropy_fused(x, ids(t, {2, 3}), 7).item(), cross_entropy_reference(x, t, 7, -100), 1e-13);
  std::vector<int64_t> ti{0, -1, 3, 6, -1, 2};
  EXPECT_NEAR(F::cross_entropy_fused(x, ids(ti, {2, 3}), 7, -1).item(), cross_entropy_reference(x, ti, 7, -1), 1e-13);
  // Every row ignored: 0, not NaN.
  std::vector<int64_t> all(6, -1);
  EXPECT_EQ(F::cross_entropy_fused(x, ids(all, {2, 3}), 7, -1).item(), 0.0);
  // The same as the plain cross entropy where nothing is padded or ignored.
  EXPECT_NEAR(F::cross_entropy_fused(x, ids(t, {2, 3})).item(),
              F::cross_entropy(x.reshape({6, 9}), ids(t, {6})).item(), 1e-13);
}

TEST(TransformerOps, FusedCrossEntropyGradients) {
  Tensor x = random_leaf({6, 9}, 21);
  Tensor t = ids({0, 6, 3, 6, 1, 2}, {6});
  EXPECT_TRUE(gradcheck([t](L in) { return F::cross_entropy_fused(in[0].mul(3.0), t); }, {x}));
  Tensor ti = ids({0, -1, 3, 6, -1, 2}, {6});
  EXPECT_TRUE(gradcheck([ti](L in) { return F::cross_entropy_fused(in[0].mul(3.0), ti, 7, -1).mul(1.7); }, {x}));
  // Padding columns get no gradient.
  Tensor xg = x.detach().clone().set_requires_grad(true);
  F::cross_entropy_fused(xg, ti, 7, -1).backward();
  auto g = xg.grad().to_vector<double>();
  for (int64_t r = 0; r < 6; ++r) {
    EXPECT_EQ(g[r * 9 + 7], 0.0);
    EXPECT_EQ(g[r * 9 + 8], 0.0);
  }
}

// Note [The classifier's gradient scaled once]: the kernel writes the mean's
// gradient; backward multiplies by the incoming gradient in place only when
// the graph is not kept, and a kept graph gives the same gradient again.
TEST(TransformerOps, FusedCrossEntropyScalesItsGradientOnce) {
  Tensor x = random_leaf({6, 9}, 23);
  Tensor t = ids({0, 6, 3, 6, 1, 2}, {6});
  auto grad_of = [&](double k, bool twice) {
    Tensor xg = x.detach().clone().set_requires_grad(true);
    Tensor loss = F::cross_entropy_fused(xg, t);
    if (k != 1.0) loss = loss.mul(k);
    loss.backward(Tensor(), /*retain_graph=*/twice);
    if (twice) loss.backward();
    return xg.grad();
  };
  // The reference: softmax - one_hot over the rows, / 6.
  auto xv = x.detach().to_vector<double>();
  std::vector<double> want(xv.size());
  const std::vector<int64_t> tv{0, 6, 3, 6, 1, 2};
  for (int64_t r = 0; r < 6; ++r) {
    double m = -1e300, z = 0;
    for (int64_t j = 0; j < 9; ++j) m = std::max(m, xv[r * 9 + j]);
    for (int64_t j = 0; j < 9; ++j) z += std::exp(xv[r * 9 + j] - m);
    for (int64_t j = 0; j < 9; ++j) want[r * 9 + j] = (std::exp(xv[r * 9 + j] - m) / z - (j == tv[r] ? 1 : 0)) / 6;
  }
  Tensor w = from_vector(want, {6, 9}, {kFloat64});
  EXPECT_LT(max_abs_diff(grad_of(1.0, false), w), 1e-15);
  EXPECT_LT(max_abs_diff(grad_of(2.5, false), w.mul(2.5)), 1e-15);
  EXPECT_LT(max_abs_diff(grad_of(1.0, true), w.mul(2.0)), 1e-15);
  EXPECT_LT(max_abs_diff(grad_of(0.5, true), w), 1e-15);
  // overwrite_logits: the gradient lands in the logits' own buffer.
  Tensor xg = x.detach().clone().set_requires_grad(true);
  Tensor logits = xg.mul(1.0);
  F::cross_entropy_fused(logits, t, 0, std::nullopt, /*overwrite_logits=*/true).backward();
  EXPECT_LT(max_abs_diff(xg.grad(), w), 1e-15);
  EXPECT_LT(max_abs_diff(logits.detach(), w), 1e-15);
}

TEST(TransformerOps, FusedCrossEntropyRejectsATargetOutsideTheVocabulary) {
  Tensor x = random_leaf({2, 9}, 22).detach();
  EXPECT_TRUE(test::throws_naming([&] { F::cross_entropy_fused(x, ids({1, 8}, {2}), 7); }, {"target 8", "row 1", "7"}));
}

// ---- embedding -----------------------------------------------------------------------------

TEST(TransformerOps, EmbeddingSumsTheGradientsOfRepeatedIndices) {
  Tensor w = random_leaf({5, 3}, 23);
  Tensor index = ids({4, 1, 4, 4, 0, 1}, {2, 3});
  EXPECT_TRUE(gradcheck([index](L in) { return F::embedding(in[0], index); }, {w}));
  w.zero_grad();
  Tensor out = F::embedding(w, index);
  EXPECT_EQ(out.sizes(), (Shape{2, 3, 3}));
  out.sum().backward();
  auto g = w.grad().to_vector<double>();
  const std::vector<double> count{1, 2, 0, 0, 3};
  for (int64_t r = 0; r < 5; ++r)
    for (int64_t c = 0; c < 3; ++c) EXPECT_EQ(g[r * 3 + c], count[r]);
}

}  // namespace
}  // namespace chorus
