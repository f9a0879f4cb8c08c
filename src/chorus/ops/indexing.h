// Raw joining and indexing ops.
#pragma once

#include "chorus/core/tensor.h"

namespace chorus::ops {

// Concatenation along `dim`; operands are brought to the first one's device.
Tensor cat(const TensorList& ts, int64_t dim);
Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index);
// zeros(shape) with out[.., index[i], ..] += src[.., i, ..]
Tensor index_add_zeros(const Shape& shape, int64_t dim, const Tensor& index, const Tensor& src);
// out[.., index[i], ..] += src[.., i, ..] in place (out contiguous, of src's dtype and device): index_add_zeros
// into a tensor that is already there.
void index_add_(const Tensor& out, int64_t dim, const Tensor& index, const Tensor& src);
Tensor gather(const Tensor& x, int64_t dim, const Tensor& index);
Tensor scatter_add_zeros(const Shape& shape, int64_t dim, const Tensor& index, const Tensor& src);
// out[.., index[i], ..] += src[i] along dim, in place (out contiguous, src's dtype and device): scatter_add_zeros
// into a tensor that is already there.
void scatter_add_(const Tensor& out, int64_t dim, const Tensor& index, const Tensor& src);

}  // namespace chorus::ops
