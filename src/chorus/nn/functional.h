// Differentiable neural-network functions (PyTorch's torch.nn.functional).
#pragma once

#include <optional>

#include "chorus/core/tensor.h"
#include "chorus/ops/nn.h"
#include "chorus/ops/transformer.h"

namespace chorus::nn::functional {

using ops::Conv2dParams;
using ops::Pool2dParams;

// y = x @ weight^T + bias; x [..., in], weight [out, in], bias [out] or undefined.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias);
// linear(gelu(linear(x, w1, b1), tanh_approximation = true), w2, b2): a GPT
// MLP, computed as one op whose matrix products carry GELU, its derivative
// and the biases (ops/linear.h) when all operands share a dtype and device.
// recompute_gelu: the backward computes GELU's output again from its input
// instead of keeping it (a quarter less of what a GPT block keeps; llm.c's
// default, its -r 1).
Tensor mlp_gelu(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2,
                bool recompute_gelu = false);
Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias, const Conv2dParams& p);
// conv2d(x, weight, bias, p) + residual (a residual block's last convolution
// and its shortcut): on a GPU the add runs in the convolution's epilogue
// (Note [Residual add in the epilogue] in cuda/conv/conv.cpp); with a bias, or a
// residual of another dtype or device, the two ops.
Tensor conv2d_add(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& residual,
                  const Conv2dParams& p);
// conv2d(x, weight) + residual as conv2d_add computes it, or left unsummed
// where the device finds that cheaper (Note [Residual add left to the batch
// norm] in ops/nn.h): {sum, undefined} or {conv2d(x, weight), residual}, for
// batch_norm_relu_sum to add. No bias.
std::pair<Tensor, Tensor> conv2d_add_unsummed(const Tensor& x, const Tensor& weight, const Tensor& residual,
                                              const Conv2dParams& p);
Tensor max_pool2d(const Tensor& x, const Pool2dParams& p);
Tensor avg_pool2d(const Tensor& x, const Pool2dParams& p);
Tensor adaptive_avg_pool2d(const Tensor& x, int64_t out_h, int64_t out_w);
// Training mode uses batch statistics and updates the running ones in place,
// and num_batches_tracked (int64 [], may be undefined) by one, in the same
// kernel on a channels-last GPU.
Tensor batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                  const Tensor& bias, bool training, double momentum, double eps,
                  const Tensor& num_batches_tracked = Tensor());
// relu(batch_norm(...)) -- one fused pass in training (Note [NHWC batch norm]
// in cuda/conv/batch_norm_nhwc.h), the two ops in evaluation.
Tensor batch_norm_relu(const Tensor& x, const Tensor& running_mean, const Tensor& running_var,
                       const Tensor& weight, const Tensor& bias, bool training, double momentum = 0.1,
                       double eps = 1e-5, const Tensor& num_batches_tracked = Tensor());
// {s, relu(batch_norm(s))} for s = a + b (b may be undefined: s = a): in
// training on a channels-last GPU the add is done by the statistics pass.
std::pair<Tensor, Tensor> batch_norm_relu_sum(const Tensor& a, const Tensor& b, const Tensor& running_mean,
                                              const Tensor& running_var, const Tensor& weight, const Tensor& bias,
                                              bool training, double momentum = 0.1, double eps = 1e-5,
                                              const Tensor& num_batches_tracked = Tensor());
Tensor dropout(const Tensor& x, double p, bool training);
// Mean cross entropy of logits [B, C] against int64 targets [B].
Tensor cross_entropy(const Tensor& logits, const Tensor& target, double label_smoothing = 0.0);
Tensor mse_loss(const Tensor& input, const Tensor& target);

// ---- transformers (nn/functional_transformer.cpp) ----------------------------
// Rows of `weight` [num, dim] picked by integer `index` (any shape): [..., dim].
// The gradient reaches `weight` summed over repeated indices, in weight's
// dtype; under autocast the rows are then cast (a float32 table's gradient is
// summed in float32).
Tensor embedding(const Tensor& weight, const Tensor& index);
// Layer norm over the last dim; weight and bias [dim] (may be undefined). Under
// autocast the input is the autocast dtype and the float32 parameters are read
// as they are (the statistics are float32 in the kernel).
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5);
// (x + r, layer_norm(x + r)): a residual add and the layer norm of its result
// as one op (Note [Residual add beside layer norm] in ops/transformer.h); x
// and r of one shape, both cast to the autocast dtype as layer_norm's input.
std::pair<Tensor, Tensor> add_layer_norm(const Tensor& x, const Tensor& r, const Tensor& weight, const Tensor& bias,
                                         double eps = 1e-5);
// GELU: exact (erf), or GPT-2's tanh approximation.
Tensor gelu(const Tensor& x, bool tanh_approximation = false);
// softmax(q k^T / sqrt(head_dim)) v over q [B, H, T, D], k and v [B, H, S, D];
// causal: query i attends to keys up to i + S - T; dropout (in training) on
// the attention probabilities, deterministic under manual_seed. `kernel`:
// the fused (flash) kernel where the device has one, or the composite
// (ops::AttentionKernel in ops/transformer.h).
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                    double dropout = 0.0, ops::AttentionKernel kernel = ops::AttentionKernel::Auto);
// Causal self-attention of a GPT block over its QKV projection [B, T, 3 C]
// (q, k, v side by side, C = heads x head_dim), returned as [B, T, C]: the
// same as splitting qkv, viewing each as [B, H, T, D] and calling
// scaled_dot_product_attention(..., causal=true), but the backward writes
// qkv's gradient as one tensor (Note [One gradient for packed q, k, v]).
Tensor causal_self_attention(const Tensor& qkv, int64_t heads, double dropout = 0.0,
                             ops::AttentionKernel kernel = ops::AttentionKernel::Auto);
// Mean cross entropy of logits [..., V] against integer targets [...] through
// the fused classifier: columns from `vocab` on are padding (0: none), rows
// whose target is `ignore_index` are left out of the mean. overwrite_logits:
// the backward's gradient is written over the logits (contiguous ones; a
// non-contiguous view is copied first) instead of a tensor of their size, for
// a caller that discards them -- they read as the gradient afterwards.
Tensor cross_entropy_fused(const Tensor& logits, const Tensor& target, int64_t vocab = 0,
                           std::optional<int64_t> ignore_index = std::nullopt, bool overwrite_logits = false);

}  // namespace chorus::nn::functional
