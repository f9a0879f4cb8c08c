// A linear layer's products with the bias riding on them (Note [Linear
// layers' epilogues] in cuda/gemm.cpp): shape checks, allocation, dispatch.
// The differentiable version is autograd::linear (nn_functions.h).
#pragma once

#include <tuple>

#include "chorus/core/tensor.h"

namespace chorus::ops {

// y = x w^T + b for x [M, K], w [N, K], b [N] of one dtype and device
// (contiguous after the call's own copies): y [M, N].
Tensor linear_bias(const Tensor& x, const Tensor& w, const Tensor& b);
// Its backward from dy [M, N]: (dx [M, K] -- undefined unless need_dx --,
// dw [N, K], db [N]), db summed while dw's product reads dy.
std::tuple<Tensor, Tensor, Tensor> linear_bias_backward(const Tensor& dy, const Tensor& x, const Tensor& w,
                                                        bool need_dx);

}  // namespace chorus::ops
