// The transformer half of nn/functional.h: argument checks and autocast rules
// around autograd/transformer_functions.h.
#include <cmath>

#include "chorus/autograd/autocast.h"
#include "chorus/autograd/functions.h"
#include "chorus/autograd/transformer_functions.h"
#include "chorus/core/error.h"
#include "chorus/nn/functional.h"

namespace chorus::nn::functional {

Tensor embedding(const Tensor& weight, const Tensor& index) {
  detail::check_defined(weight, "embedding", "weight");
  detail::check_defined(index, "embedding", "index");
  CHORUS_CHECK(weight.dim() == 2, "embedding: weight must be [num_embeddings, dim], got ", weight.describe());
  CHORUS_CHECK(index.dtype() == kInt64 || index.dtype() == kInt32, "embedding: indices must be integers, got ",
               index.describe());
  Shape out = index.sizes();
  out.push_back(weight.size(1));
  Tensor flat = index.reshape({index.numel()}).to(weight.device(), kInt64);
  Tensor rows = chorus::index_select(weight, 0, flat).reshape(out);
  if (auto dt = autocast_dtype(rows)) return rows.to(*dt);
  return rows;
}

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  detail::check_defined(x, "layer_norm", "input");
  Tensor in = x;
  if (auto dt = autocast_dtype(x)) in = x.to(*dt);
  return autograd::layer_norm(in, weight, bias, eps);
}

std::pair<Tensor, Tensor> add_layer_norm(const Tensor& x, const Tensor& r, const Tensor& weight, const Tensor& bias,
                                         double eps) {
  detail::check_defined(x, "add_layer_norm", "input");
  detail::check_defined(r, "add_layer_norm", "residual branch");
  Tensor a = x, b = r;
  if (auto dt = autocast_dtype(x)) {
    a = x.to(*dt);
    b = r.to(*dt);
  }
  return autograd::add_layer_norm(a, b, weight, bias, eps);
}

Tensor gelu(const Tensor& x, bool tanh_approximation) {
  detail::check_defined(x, "gelu", "input");
  CHORUS_CHECK(is_floating(x.dtype()), "gelu: expected a floating tensor, got ", x.describe());
  return autograd::gelu(x, tanh_approximation);
}

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double dropout,
                                    ops::AttentionKernel kernel) {
  detail::check_defined(q, "scaled_dot_product_attention", "q");
  CHORUS_CHECK(q.dim() == 4, "scaled_dot_product_attention: q must be [batch, heads, seq, head_dim], got ",
               q.describe());
  Tensor qq = q, kk = k, vv = v;
  if (auto dt = autocast_dtype(q)) {
    qq = q.to(*dt);
    kk = k.to(*dt);
    vv = v.to(*dt);
  }
  return autograd::attention(qq, kk, vv, causal, 1.0 / std::sqrt(static_cast<double>(q.size(3))), dropout, kernel);
}

Tensor causal_self_attention(const Tensor& qkv, int64_t heads, double dropout, ops::AttentionKernel kernel) {
  detail::check_defined(qkv, "causal_self_attention", "qkv");
  CHORUS_CHECK(qkv.dim() == 3 && heads >= 1 && qkv.size(2) % (3 * heads) == 0,
               "causal_self_attention: qkv must be [batch, seq, 3 x heads x head_dim] for ", heads, " heads, got ",
               qkv.describe());
  Tensor in = qkv;
  if (auto dt = autocast_dtype(qkv)) in = qkv.to(*dt);
  const int64_t b = qkv.size(0), t = qkv.size(1), width = qkv.size(2) / 3;
  const double scale = 1.0 / std::sqrt(static_cast<double>(width / heads));
  Tensor y = autograd::attention_packed(in, heads, /*causal=*/true, scale, dropout, kernel);  // [B, H, T, D]
  return y.permute({0, 2, 1, 3}).reshape({b, t, width});
}

Tensor cross_entropy_fused(const Tensor& logits, const Tensor& target, int64_t vocab,
                           std::optional<int64_t> ignore_index, bool overwrite_logits) {
  detail::check_defined(logits, "cross_entropy", "logits");
  detail::check_defined(target, "cross_entropy", "target");
  CHORUS_CHECK(logits.dim() >= 1 && logits.dim() == target.dim() + 1, "cross_entropy: logits ", logits.describe(),
               " must have one dim more than the targets ", target.describe());
  for (int64_t d = 0; d < target.dim(); ++d) {
    CHORUS_CHECK(logits.size(d) == target.size(d), "cross_entropy: logits ", shape_str(logits.sizes()),
                 " do not match targets ", shape_str(target.sizes()));
  }
  const int64_t v = logits.size(-1);
  CHORUS_CHECK(vocab >= 0 && vocab <= v, "cross_entropy: vocabulary ", vocab, " is larger than the logits' ", v,
               " columns");
  return autograd::cross_entropy_fused_mean(logits.reshape({logits.numel() / std::max<int64_t>(v, 1), v}),
                                            target.reshape({target.numel()}), vocab ? vocab : v, ignore_index,
                                            overwrite_logits);
}

}  // namespace chorus::nn::functional
