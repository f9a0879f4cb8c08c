// GELU's gradient at a GPT MLP's hidden layer, with the first product's bias
// gradient summed in the same pass (Note [GELU's gradient with the bias
// gradient] in gelu_grad.cu). CUDA only; the kernel set's gemm_dgelu uses it.
#pragma once

#include "chorus/core/tensor.h"

namespace chorus::cuda {

// d = d * gelu_tanh'(pre) in place, and bias_grad [cols] (d's dtype, or
// float32) = the column sums of the new d, for d and pre [rows, cols],
// contiguous, one dtype, on one CUDA device. Enqueued on the current stream.
void gelu_tanh_grad_colsum(const Tensor& d, const Tensor& pre, const Tensor& bias_grad);

}  // namespace chorus::cuda
