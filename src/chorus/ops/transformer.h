// Raw transformer ops: layer norm, scaled-dot-product attention and the fused
// classifier + cross entropy, with their backward passes. Shape checks, output
// allocation and dispatch; the differentiable versions are in
// autograd/transformer_functions.h and nn/functional.h.
#pragma once

#include <string>
#include <tuple>
#include <utility>

#include "chorus/core/tensor.h"

namespace chorus::ops {

// Layer norm over the last dim: (y, mean, rstd). gamma, beta: [x.size(-1)] of
// x's dtype or float32, each may be undefined.
std::tuple<Tensor, Tensor, Tensor> layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps);
// (dx, dgamma, dbeta); dgamma/dbeta in gamma's dtype, undefined unless asked.
// dresidual, when defined (x's shape), is added to dx by the same kernel.
std::tuple<Tensor, Tensor, Tensor> layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                                       const Tensor& mean, const Tensor& rstd, bool need_dgamma,
                                                       bool need_dbeta, const Tensor& dresidual = Tensor());

// Note [Residual add beside layer norm]: a pre-LayerNorm transformer adds
// each branch's output to the residual stream and normalises the result
// straight away (the next branch's input, or the final norm's). As llm.c's
// fused_residual_forward does, one kernel reads the residual x and the
// branch output r once and writes both the new residual sum = x + r and
// layer_norm(sum) (with mean and rstd), instead of an add that writes sum
// and a layer norm that reads it back. In the backward the sum's gradient is
// d(sum) from the residual path plus the layer norm's input gradient, and x
// and r both get that total; the layer norm's backward kernel adds d(sum) as
// it writes its dx (llm.c's layernorm_backward accumulates into the
// residual's gradient), so no separate add kernel runs there either. The norm
// is taken of sum as stored (rounded to its dtype), so the fused op computes
// exactly what add followed by layer_norm computes.
// Returns (sum, y, mean, rstd); x and r of one floating dtype and shape.
std::tuple<Tensor, Tensor, Tensor, Tensor> add_layer_norm(const Tensor& x, const Tensor& r, const Tensor& gamma,
                                                          const Tensor& beta, double eps);

// Which kernels compute attention. Auto: the fused kernel where the device
// has one for the case (Note [Fused attention graphs] in
// cuda/cudnn/flash_attention.cpp: cuDNN on CUDA, 16-bit floats, head_dim <= 128, no
// dropout, T == S when causal), else the composite; Fused: the fused kernel
// or a ValueError saying why not; Composite: always the composite.
enum class AttentionKernel { Auto, Fused, Composite };
const char* attention_kernel_name(AttentionKernel k);  // "auto", "fused", "composite"
// Throws ValueError naming the accepted names.
AttentionKernel parse_attention_kernel(const std::string& name);

// What the backward of attention needs: the fused path keeps out and each
// row's log-sum-exp (stats [B, H, T] float32), the composite the
// probabilities and the dropout mask.
struct AttentionSaved {
  Tensor out, probs, mask, stats;
  bool fused = false;
};

// Note [Attention through two products]: softmax(scale * q k^T) v over
// q [B, H, T, D] and k, v [B, H, S, D] (one dtype and device). The composite
// path is a batched GEMM, attention's softmax (causal: query i sees keys up
// to i + S - T) and a second GEMM, as llm.c's path without cuDNN does; the
// probabilities [B*H, T, S] are kept for the backward. With dropout p > 0
// the probabilities are multiplied by a mask of 0 and 1/(1-p) drawn from the
// default generator before the second product. The fused path writes out as
// a [B, T, H, D]-ordered tensor seen as [B, H, T, D] (so the heads' merge
// back to [B, T, H*D] is free) and never stores the scores.
AttentionSaved attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale,
                         double dropout = 0.0, AttentionKernel kernel = AttentionKernel::Auto);
// (dq, dk, dv) from the output's gradient and what the forward saved.
std::tuple<Tensor, Tensor, Tensor> attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                      const Tensor& v, const AttentionSaved& saved, bool causal,
                                                      double scale);
// The same gradients written into dq, dk, dv (views of the caller's, e.g. the
// slices of one packed [B, T, 3, H, D] gradient: the fused kernel writes them
// in place with their strides, the composite path copies).
void attention_backward_into(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                             const AttentionSaved& saved, bool causal, double scale, const Tensor& dq,
                             const Tensor& dk, const Tensor& dv);

// The fused classifier over logits [N, V] and int64 targets [N] (cpu/cuda
// cross_entropy_fused): (losses [N] float32 -- float64 for float64 logits --,
// dlogits [N, V] in the logits' dtype, each row's loss gradient times
// grad_scale, a one-element tensor read on the device: 1/N for a mean; none:
// 1). Columns from valid_cols on are vocabulary padding; rows whose target is
// ignore_index count for nothing. overwrite_logits: dlogits is written over
// contiguous logits (which then hold it), for a caller that discards them.
std::pair<Tensor, Tensor> cross_entropy_fused(const Tensor& logits, const Tensor& target, int64_t valid_cols,
                                              int64_t ignore_index, const Tensor& grad_scale = Tensor(),
                                              bool overwrite_logits = false);
// x *= scale in place, where scale is a one-element tensor read on x's device;
// nothing is written when it is exactly 1 (cpu/cuda scale_unless_one).
void scale_unless_one_(const Tensor& x, const Tensor& scale);

}  // namespace chorus::ops
