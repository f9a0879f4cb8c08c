#include "chorus/ops/indexing.h"

#include "chorus/core/error.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/dispatch.h"
#include "chorus/ops/elementwise.h"

namespace chorus::ops {

Tensor cat(const TensorList& ts, int64_t dim) {
  CHORUS_CHECK(!ts.empty(), "cat: expected at least one tensor");
  for (size_t i = 0; i < ts.size(); ++i) detail::check_defined(ts[i], "cat", "tensors");
  const Tensor& first = ts[0];
  dim = wrap_dim(dim, first.dim(), "cat");
  Shape out_shape = first.sizes();
  DType dt = first.dtype();
  int64_t total = 0;
  for (size_t i = 0; i < ts.size(); ++i) {
    const Tensor& t = ts[i];
    CHORUS_CHECK(t.dim() == first.dim(), "cat: tensor ", i, " has shape ", shape_str(t.sizes()),
                 " but tensor 0 has ", shape_str(first.sizes()), " (different number of dims)");
    for (int64_t d = 0; d < t.dim(); ++d)
      CHORUS_CHECK(d == dim || t.size(d) == first.size(d), "cat: tensor ", i, " has shape ",
                   shape_str(t.sizes()), " but tensor 0 has ", shape_str(first.sizes()),
                   " (sizes must match except in dim ", dim, ")");
    total += t.size(dim);
    dt = promote_types(dt, t.dtype());
  }
  out_shape[dim] = total;
  Tensor out = detail::empty_tensor(out_shape, dt, first.device());
  int64_t pos = 0;
  for (const Tensor& t : ts) {
    Shape sizes = out_shape;
    sizes[dim] = t.size(dim);
    Tensor slot = detail::make_view(out, sizes, out.strides(), pos * out.stride(dim));
    if (t.numel()) copy_(slot, t);
    pos += t.size(dim);
  }
  return out;
}

namespace {
Tensor checked_index(const Tensor& index, Device dev, const char* op) {
  detail::check_defined(index, op, "index");
  CHORUS_CHECK(index.dtype() == kInt64 || index.dtype() == kInt32, op, ": index must be an integer tensor, got ",
               index.describe());
  return contiguous(to_dtype(to_device(index, dev), kInt64));
}
}  // namespace

Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index) {
  dim = wrap_dim(dim, x.dim(), "index_select");
  CHORUS_CHECK(index.dim() == 1, "index_select: index must be 1-d, got ", index.describe());
  Tensor idx = checked_index(index, x.device(), "index_select");
  Tensor xx = contiguous(x);
  Shape s = x.sizes();
  s[dim] = idx.size(0);
  Tensor out = detail::empty_tensor(s, x.dtype(), x.device());
  if (out.numel()) CHORUS_KERNEL(x.device(), index_select, xx, dim, idx, out);
  return out;
}

namespace {

// Checks `out` for an in-place add of `src`'s values (op: "index_add_" or
// "scatter_add_") and returns the checked index.
Tensor checked_add_into(const Tensor& out, const Tensor& index, const Tensor& src, const char* op, const char* kernel) {
  detail::check_defined(out, op, "out");
  detail::check_defined(src, op, "src");
  CHORUS_CHECK(out.is_contiguous() && out.dtype() == src.dtype() && out.device() == src.device(), op, ": out ",
               out.describe(), " must be contiguous, of src's dtype and device (src ", src.describe(), ")");
  return checked_index(index, src.device(), kernel);
}

}  // namespace

Tensor index_add_zeros(const Shape& shape, int64_t dim, const Tensor& index, const Tensor& src) {
  Tensor out = detail::empty_tensor(shape, src.dtype(), src.device());
  fill_(out, 0);
  Tensor idx = checked_index(index, src.device(), "index_add");
  if (src.numel()) CHORUS_KERNEL(src.device(), index_add, out, dim, idx, contiguous(src));
  return out;
}

void index_add_(const Tensor& out, int64_t dim, const Tensor& index, const Tensor& src) {
  Tensor idx = checked_add_into(out, index, src, "index_add_", "index_add");
  if (src.numel()) CHORUS_KERNEL(src.device(), index_add, out, dim, idx, contiguous(src));
  out.bump_version();
}

Tensor gather(const Tensor& x, int64_t dim, const Tensor& index) {
  dim = wrap_dim(dim, x.dim(), "gather");
  CHORUS_CHECK(index.dim() == x.dim(), "gather: index ", index.describe(), " must have as many dims as input ",
               x.describe());
  for (int64_t d = 0; d < x.dim(); ++d)
    CHORUS_CHECK(d == dim || index.size(d) <= x.size(d), "gather: index ", shape_str(index.sizes()),
                 " is larger than input ", shape_str(x.sizes()), " in dim ", d);
  Tensor idx = checked_index(index, x.device(), "gather");
  Tensor out = detail::empty_tensor(idx.sizes(), x.dtype(), x.device());
  if (out.numel()) CHORUS_KERNEL(x.device(), gather, contiguous(x), dim, idx, out);
  return out;
}

Tensor scatter_add_zeros(const Shape& shape, int64_t dim, const Tensor& index, const Tensor& src) {
  Tensor out = detail::empty_tensor(shape, src.dtype(), src.device());
  fill_(out, 0);
  Tensor idx = checked_index(index, src.device(), "scatter_add");
  if (src.numel()) CHORUS_KERNEL(src.device(), scatter_add, out, dim, idx, contiguous(src));
  return out;
}

void scatter_add_(const Tensor& out, int64_t dim, const Tensor& index, const Tensor& src) {
  Tensor idx = checked_add_into(out, index, src, "scatter_add_", "scatter_add");
  if (src.numel()) CHORUS_KERNEL(src.device(), scatter_add, out, dim, idx, contiguous(src));
  out.bump_version();
}

}  // namespace chorus::ops
