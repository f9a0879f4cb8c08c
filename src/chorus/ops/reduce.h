// Raw reductions over a set of dims (empty dims = all).
#pragma once

#include "chorus/core/op_kinds.h"
#include "chorus/core/tensor.h"

namespace chorus::ops {

Tensor reduce(ReduceOp op, const Tensor& x, const Shape& dims, bool keepdim);
// Sums `g` down to `shape` (the inverse of broadcasting), for gradients.
Tensor sum_to(const Tensor& g, const Shape& shape);

}  // namespace chorus::ops
