// Differentiable transformer ops: the forward through ops/transformer.h, the
// backward recorded on the graph. No autocast here: nn/functional.h, the
// user-facing API, decides dtypes and calls these.
#pragma once

#include <optional>
#include <utility>

#include "chorus/core/tensor.h"
#include "chorus/ops/transformer.h"

namespace chorus::autograd {

// GELU, exact (erf) or with GPT-2's tanh approximation.
Tensor gelu(const Tensor& x, bool tanh_approximation);
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps);
// (x + r, layer_norm(x + r)) in one op (Note [Residual add beside layer norm]
// in ops/transformer.h); x and r get one gradient, d(sum) plus the norm's.
std::pair<Tensor, Tensor> add_layer_norm(const Tensor& x, const Tensor& r, const Tensor& weight, const Tensor& bias,
                                         double eps);
// softmax(scale * q k^T) v over [batch, heads, seq, head_dim] (Note [Attention
// through two products] in ops/transformer.h); dropout on the probabilities
// when p > 0; `kernel` picks the fused or the composite path.
Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale, double dropout = 0.0,
                 ops::AttentionKernel kernel = ops::AttentionKernel::Auto);
// attention() over q, k, v packed side by side in one [batch, seq, 3 x heads x
// head_dim] tensor (a GPT's QKV projection), returned as [batch, heads, seq,
// head_dim]; the backward gives qkv one gradient, written in place.
Tensor attention_packed(const Tensor& qkv, int64_t heads, bool causal, double scale, double dropout = 0.0,
                        ops::AttentionKernel kernel = ops::AttentionKernel::Auto);
// Mean cross entropy of logits [N, V] against int64 targets [N] through the
// fused classifier: columns from valid_cols on are vocabulary padding, rows
// whose target is ignore_index are left out of the mean (0 when every row
// is). The forward computes each row's gradient too, so nothing of the
// softmax is kept but that gradient (the logits' size, in their dtype).
Tensor cross_entropy_fused_mean(const Tensor& logits, const Tensor& target, int64_t valid_cols,
                                std::optional<int64_t> ignore_index, bool overwrite_logits = false);

}  // namespace chorus::autograd
