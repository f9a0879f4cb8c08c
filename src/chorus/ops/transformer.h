// Raw transformer ops: layer norm, scaled-dot-product attention and the fused
// classifier + cross entropy, with their backward passes. Shape checks, output
// allocation and dispatch; the differentiable versions are in
// autograd/transformer_functions.h and nn/functional.h.
#pragma once

#include <tuple>
#include <utility>

#include "chorus/core/tensor.h"

namespace chorus::ops {

// Layer norm over the last dim: (y, mean, rstd). gamma, beta: [x.size(-1)] of
// x's dtype or float32, each may be undefined.
std::tuple<Tensor, Tensor, Tensor> layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps);
// (dx, dgamma, dbeta); dgamma/dbeta in gamma's dtype, undefined unless asked.
std::tuple<Tensor, Tensor, Tensor> layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                                       const Tensor& mean, const Tensor& rstd, bool need_dgamma,
                                                       bool need_dbeta);

// Note [Attention through two products]: softmax(scale * q k^T) v over
// q [B, H, T, D] and k, v [B, H, S, D] (one dtype and device), computed as a
// batched GEMM, attention's softmax (causal: query i sees keys up to
// i + S - T) and a second GEMM, as llm.c's path without cuDNN does. The
// probabilities [B*H, T, S] are kept for the backward. With dropout p > 0
// the probabilities are multiplied by a mask of 0 and 1/(1-p) drawn from the
// default generator before the second product. Returns (out [B, H, T, D],
// probs, mask -- undefined without dropout).
std::tuple<Tensor, Tensor, Tensor> attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                             double scale, double dropout = 0.0);
// (dq, dk, dv) from the output's gradient, the forward's probabilities and its
// dropout mask (undefined: none).
std::tuple<Tensor, Tensor, Tensor> attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                      const Tensor& v, const Tensor& probs, const Tensor& mask,
                                                      bool causal, double scale);

// The fused classifier over logits [N, V] and int64 targets [N] (cpu/cuda
// cross_entropy_fused): (losses [N] float32 -- float64 for float64 logits --,
// dlogits [N, V] in the logits' dtype, each row's loss gradient). Columns from
// valid_cols on are vocabulary padding; rows whose target is ignore_index
// count for nothing.
std::pair<Tensor, Tensor> cross_entropy_fused(const Tensor& logits, const Tensor& target, int64_t valid_cols,
                                              int64_t ignore_index);

}  // namespace chorus::ops
