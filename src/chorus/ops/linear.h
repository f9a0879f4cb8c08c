// A linear layer's products with the bias riding on them (Note [Linear
// layers' epilogues] in cuda/blas/gemm.cpp): shape checks, allocation, dispatch.
// The differentiable version is autograd::linear (nn_functions.h).
#pragma once

#include <optional>
#include <tuple>
#include <vector>

#include "chorus/core/tensor.h"

namespace chorus::ops {

// y = x w^T + b for x [M, K], w [N, K], b [N] of one dtype and device
// (contiguous after the call's own copies): y [M, N].
Tensor linear_bias(const Tensor& x, const Tensor& w, const Tensor& b);
// The same into y [M, N] (contiguous, x's dtype and device; a slice of a
// larger buffer is fine); b may be undefined (no bias).
void linear_bias_into(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y);
// dx = dy w into dx [M, K] (contiguous): the input gradient of a linear layer
// for dy [M, N], w [N, K] of one dtype and device.
void linear_input_grad_into(const Tensor& dy, const Tensor& w, const Tensor& dx);
// Its backward from dy [M, N]: (dx [M, K] -- undefined unless need_dx --,
// dw [N, K], db [N] -- undefined unless need_db), db summed while dw's
// product reads dy. grad_dtype (default: w's) is dw's and db's: float32 for
// a float32 weight whose 16-bit copy w is (Note [Float weight gradients from
// 16-bit products] in cuda/blas/gemm.cpp).
std::tuple<Tensor, Tensor, Tensor> linear_bias_backward(const Tensor& dy, const Tensor& x, const Tensor& w,
                                                        bool need_dx, bool need_db = true,
                                                        std::optional<DType> grad_dtype = std::nullopt);

// A GPT MLP, y = gelu_tanh(x w1^T + b1) w2^T + b2, with GELU in the
// products' epilogues (Note [GELU in the MLP's epilogues] in cuda/blas/gemm.cpp):
// x [M, C], w1 [H, C], b1 [H], w2 [C, H], b2 [C] of one dtype and device.
// Returns (y [M, C], pre [M, H], h [M, H]): GELU's input and output, which
// the backward reads.
std::tuple<Tensor, Tensor, Tensor> mlp_gelu(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2,
                                            const Tensor& b2);
// The same into y [M, C], pre and h [M, H] (contiguous; slices of larger
// buffers are fine: tp::sp_mlp runs it on chunks of its rows).
void mlp_gelu_into(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2,
                   const Tensor& y, const Tensor& pre, const Tensor& h);
// The backward of its second product and GELU from dy [M, C]: (dpre [M, H],
// the gradient at GELU's input, dw2, db2) -- for a caller that does the
// first product's backward itself (tp::sp_mlp overlaps it with a collective).
// With db1 given, *db1 becomes the first product's bias gradient (dpre's
// column sums, summed by the pass that makes dpre: Note [GELU's gradient with
// the bias gradient] in cuda/kernels/column_sums.cu), in grad_dtype too.
std::tuple<Tensor, Tensor, Tensor> mlp_gelu_backward_second(const Tensor& dy, const Tensor& w2, const Tensor& pre,
                                                            const Tensor& h,
                                                            std::optional<DType> grad_dtype = std::nullopt,
                                                            Tensor* db1 = nullptr);
// Its backward from dy [M, C]: {dx (undefined unless need_dx), dw1, db1, dw2,
// db2}, the parameters' gradients in grad_dtype (default: the weights').
std::vector<Tensor> mlp_gelu_backward(const Tensor& dy, const Tensor& x, const Tensor& w1, const Tensor& w2,
                                      const Tensor& pre, const Tensor& h, bool need_dx,
                                      std::optional<DType> grad_dtype = std::nullopt);

}  // namespace chorus::ops
