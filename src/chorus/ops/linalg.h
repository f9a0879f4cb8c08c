// Matrix products (raw). matmul accepts [M,K]@[K,N], [...,M,K]@[K,N] and
// [B,M,K]@[B,K,N]; transposed views of contiguous matrices are passed to the
// GEMM as transposes, never copied.
#pragma once

#include "chorus/core/tensor.h"

namespace chorus::ops {

Tensor matmul(const Tensor& a, const Tensor& b);

}  // namespace chorus::ops
