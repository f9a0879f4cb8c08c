// A column-parallel linear layer's input all-gather and product as one
// autograd op under sequence parallelism, so that its backward can overlap
// the reduce-scatter of the input's gradient with the weight's gradient.
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

}  // namespace chorus::tp
