// The linear layers of sequence parallelism with their collectives, each as
// one autograd op: the column-parallel layer's input all-gather and product
// (so that its backward can overlap the reduce-scatter of the input's
// gradient with the weight's gradient), and the row-parallel layer's product
// and reduce-scatter (its bias riding on one rank's product).
//
// Note [Reduce-scatter beside the weight gradient]: composed from
// gather_from_sp and a linear layer, the backward computed dx_full, dw and db
// in the linear node and then reduce-scattered dx_full in the next node, the
// compute stream waiting for it -- nothing to overlap with. Here the
// backward computes dx_full first, issues its reduce-scatter, then the
// weight's and bias's gradients (which do not depend on it) while the
// collective runs, and waits last. Over NCCL the two overlap on the device;
// over Gloo the order is the same and the result identical.
//
// Note [Chunked collectives beside the products]: in the forward the
// all-gather of a column-parallel op came before its product and the
// reduce-scatter of a row-parallel op after its product, the compute stream
// idle for both. With `chunks` K > 1 (TPContext::chunks, `--tp-chunks`)
// each rank's m tokens go in K chunks of m/K rows (Megatron's and PyTorch's
// "async TP"): the column-parallel side issues the K all-gathers at once
// (they run one after another on the communication stream) and multiplies
// chunk k as soon as its gather has landed, while chunk k+1's is in flight;
// the row-parallel side issues chunk k's reduce-scatter as soon as its
// product is done and multiplies chunk k+1 beside it, waiting for all of
// them last. So one chunk's collective, not the whole op's, is left on the
// critical path at each end. Each gather lands its chunk of every rank side
// by side, so the region's rows are chunk-major over rank-major blocks
// (chunks.h; Note [Rank-major activations] in layers.h), and each
// reduce-scatter takes the same block back to this rank's chunk. The
// backward mirrors it: the input gradient's reduce-scatter goes chunk by
// chunk beside the next chunk's product and the weight gradient; the
// row-parallel side multiplies each gathered chunk of the output's gradient
// while the next is gathered. K that does not divide m falls back to one
// chunk (effective_chunks). Over Gloo the same order runs, synchronously;
// the result is K = 1's but for the order in which the weight gradients sum
// over the tokens.
#pragma once

#include "chorus/core/tensor.h"
#include "chorus/distributed/process_group.h"

namespace chorus::tp {

// x [B, T/tp, in] (this rank's sequence chunk), weight [out/tp, in], bias
// [out/tp] -> the rank-major [tp * B, T/tp, out/tp] (Note [Rank-major
// activations] in layers.h): gather_from_sp(x, group, 0) through the linear
// layer, with autocast as nn::functional::linear. Falls back to exactly
// that composition where the fused op does not apply (no bias, mixed dtypes
// or devices).
// chunks > 1: the rows chunk-major (Note [Chunked collectives beside the products]).
Tensor gather_linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const dist::ProcessGroupPtr& group,
                     int chunks = 1);

// Note [The row-parallel bias on one rank]: y = sum_r x_r W_r^T + b,
// reduce-scattered to this rank's chunk. The bias rides on rank 0's product
// (the GEMM's epilogue; the other ranks add a zero bias), so the sum over
// the ranks holds it once and no separate addition (a float pass over the
// chunk forward and a reduction backward) is left. Its gradient, the column
// sums of the output's gradient over every token, is what each rank's weight
// gradient product computes anyway from the all-gathered gradient: every
// rank gets the whole of it, with no all-reduce.
// x rank-major [tp * B, T/tp, in/tp] (chunk-major over it for chunks > 1), weight [out, in/tp], bias [out]
// (replicated) -> [B, T/tp, out]; autocast as nn::functional::linear. Falls
// back to the composition (product, reduce_scatter_to_sp, then the bias
// through copy_param_to_tp) where the fused op does not apply.
Tensor linear_reduce_scatter(const Tensor& x, const Tensor& weight, const Tensor& bias,
                             const dist::ProcessGroupPtr& group, int chunks = 1);

// The GPT MLP under sequence parallelism as one op: the all-gather of x's
// chunks, gelu_tanh(x W1_r^T + b1_r) W2_r^T (+ b2 on rank 0: Note [The
// row-parallel bias on one rank]) with GELU in the products' epilogues as
// the one-GPU model's MLP (Note [GELU in the MLP's epilogues] in
// cuda/blas/gemm.cpp), and the reduce-scatter of the sum; its backward overlaps
// the reduce-scatter of x's gradient with the first matrix's gradient (Note
// [Reduce-scatter beside the weight gradient]). x [B, T/tp, C], w1 [H/tp, C],
// b1 [H/tp], w2 [C, H/tp], b2 [C] -> [B, T/tp, C]; autocast as
// nn::functional::mlp_gelu. Falls back to gather_linear, GELU and
// linear_reduce_scatter where the fused op does not apply. chunks > 1: both
// collectives in chunks beside the products of the other chunks (Note
// [Chunked collectives beside the products]).
Tensor sp_mlp(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2,
              const dist::ProcessGroupPtr& group, int chunks = 1);

}  // namespace chorus::tp
