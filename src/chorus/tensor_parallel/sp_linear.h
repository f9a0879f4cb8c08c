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
#pragma once

#include "chorus/core/tensor.h"
#include "chorus/dist/process_group.h"

namespace chorus::tp {

// x [B, T/tp, in] (this rank's sequence chunk), weight [out/tp, in], bias
// [out/tp] -> the rank-major [tp * B, T/tp, out/tp] (Note [Rank-major
// activations] in layers.h): gather_from_sp(x, group, 0) through the linear
// layer, with autocast as nn::functional::linear. Falls back to exactly
// that composition where the fused op does not apply (no bias, mixed dtypes
// or devices).
Tensor gather_linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const dist::ProcessGroupPtr& group);

// Note [The row-parallel bias on one rank]: y = sum_r x_r W_r^T + b,
// reduce-scattered to this rank's chunk. The bias rides on rank 0's product
// (the GEMM's epilogue; the other ranks add a zero bias), so the sum over
// the ranks holds it once and no separate addition (a float pass over the
// chunk forward and a reduction backward) is left. Its gradient, the column
// sums of the output's gradient over every token, is what each rank's weight
// gradient product computes anyway from the all-gathered gradient: every
// rank gets the whole of it, with no all-reduce.
// x rank-major [tp * B, T/tp, in/tp], weight [out, in/tp], bias [out]
// (replicated) -> [B, T/tp, out]; autocast as nn::functional::linear. Falls
// back to the composition (product, reduce_scatter_to_sp, then the bias
// through copy_param_to_tp) where the fused op does not apply.
Tensor linear_reduce_scatter(const Tensor& x, const Tensor& weight, const Tensor& bias,
                             const dist::ProcessGroupPtr& group);

// The GPT MLP under sequence parallelism as one op: the all-gather of x's
// chunks, gelu_tanh(x W1_r^T + b1_r) W2_r^T (+ b2 on rank 0: Note [The
// row-parallel bias on one rank]) with GELU in the products' epilogues as
// the one-GPU model's MLP (Note [GELU in the MLP's epilogues] in
// cuda/gemm.cpp), and the reduce-scatter of the sum; its backward overlaps
// the reduce-scatter of x's gradient with the first matrix's gradient (Note
// [Reduce-scatter beside the weight gradient]). x [B, T/tp, C], w1 [H/tp, C],
// b1 [H/tp], w2 [C, H/tp], b2 [C] -> [B, T/tp, C]; autocast as
// nn::functional::mlp_gelu. Falls back to gather_linear, GELU and
// linear_reduce_scatter where the fused op does not apply.
Tensor sp_mlp(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2,
              const dist::ProcessGroupPtr& group);

}  // namespace chorus::tp
