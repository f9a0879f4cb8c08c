// Column sums of a matrix on CUDA: a linear layer's bias gradient from its
// output's gradient, alone or with GELU's gradient made in the same pass
// (Note [Bias gradients as column sums] in column_sums.cu). CUDA only; the
// kernel set's gemm_bias and gemm_dgelu use them.
#pragma once

#include "chorus/core/tensor.h"

namespace chorus::cuda {

// sums [cols] (x's dtype, or float32) = the column sums of x [rows, cols]
// (contiguous, on one CUDA device), in a fixed order. Enqueued on the current stream.
void column_sums(const Tensor& x, const Tensor& sums);
// d = d * gelu_tanh'(pre) in place, and bias_grad [cols] (d's dtype, or
// float32) = the column sums of the new d, for d and pre [rows, cols],
// contiguous, one dtype, on one CUDA device.
void gelu_tanh_grad_colsum(const Tensor& d, const Tensor& pre, const Tensor& bias_grad);

}  // namespace chorus::cuda
