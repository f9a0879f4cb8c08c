// Raw views: new geometry over the same storage (no copy, no autograd). The
// differentiable versions are Tensor's methods.
#pragma once

#include "chorus/core/tensor.h"

namespace chorus::ops {

// Resolves one -1 in `shape` against numel; checks the element count.
Shape infer_shape(const Shape& shape, int64_t numel, const char* op);
// A view when the strides allow it, else a contiguous copy (reshape's rule).
Tensor reshape(const Tensor& t, const Shape& shape);
// A view only; throws when the strides do not allow it (view's rule).
Tensor view(const Tensor& t, const Shape& shape);
Tensor permute(const Tensor& t, const Shape& dims);
Tensor slice(const Tensor& t, int64_t dim, int64_t start, int64_t end, int64_t step);
Tensor select(const Tensor& t, int64_t dim, int64_t index);
Tensor expand(const Tensor& t, const Shape& shape);
Tensor squeeze(const Tensor& t, int64_t dim);
Tensor unsqueeze(const Tensor& t, int64_t dim);

}  // namespace chorus::ops
