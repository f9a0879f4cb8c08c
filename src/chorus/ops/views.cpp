#include "chorus/ops/views.h"

#include "chorus/core/error.h"
#include "chorus/ops/copy.h"

#include <utility>

namespace chorus::ops {

Shape infer_shape(const Shape& shape, int64_t numel, const char* op) {
  Shape out = shape;
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] == -1) {
      CHORUS_CHECK(infer < 0, op, ": only one dimension can be -1 in ", shape_str(shape));
      infer = static_cast<int64_t>(i);
    } else {
      CHORUS_CHECK(out[i] >= 0, op, ": invalid size ", out[i], " in ", shape_str(shape));
      known *= out[i];
    }
  }
  if (infer >= 0) {
    CHORUS_CHECK(known != 0 && numel % known == 0, op, ": shape ", shape_str(shape),
                 " is invalid for a tensor of ", numel, " elements");
    out[infer] = numel / known;
  }
  CHORUS_CHECK(numel_of(out) == numel, op, ": shape ", shape_str(shape), " is invalid for a tensor of ",
               numel, " elements");
  return out;
}

namespace {
// Strides for viewing t as `shape` without a copy, if possible (PyTorch's
// computeStride: groups of dims that are contiguous among themselves).
bool view_strides(const Tensor& t, const Shape& shape, Shape* out) {
  if (t.is_contiguous()) {
    *out = contiguous_strides(shape);
    return true;
  }
  const Shape& os = t.sizes();
  const Shape& ost = t.strides();
  Shape st(shape.size(), 1);
  int64_t view_d = static_cast<int64_t>(shape.size()) - 1;
  int64_t chunk_base = ost.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int64_t d = static_cast<int64_t>(os.size()) - 1; d >= 0; --d) {
    tensor_numel *= os[d];
    if (d == 0 || (os[d - 1] != 1 && ost[d - 1] != tensor_numel * chunk_base)) {
      while (view_d >= 0 && (view_numel < tensor_numel || shape[view_d] == 1)) {
        st[view_d] = view_numel * chunk_base;
        view_numel *= shape[view_d];
        --view_d;
      }
      if (view_numel != tensor_numel) return false;
      if (d > 0) {
        chunk_base = ost[d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) return false;
  *out = st;
  return true;
}
}  // namespace

Tensor view(const Tensor& t, const Shape& shape) {
  Shape s = infer_shape(shape, t.numel(), "view");
  Shape st;
  CHORUS_CHECK(view_strides(t, s, &st), "view: ", t.describe(), " with strides ", shape_str(t.strides()),
               " cannot be viewed as ", shape_str(s), " without a copy; use reshape()");
  return detail::make_view(t, std::move(s), std::move(st), t.storage_offset());
}

Tensor reshape(const Tensor& t, const Shape& shape) {
  Shape s = infer_shape(shape, t.numel(), "reshape");
  Shape st;
  if (view_strides(t, s, &st)) return detail::make_view(t, std::move(s), std::move(st), t.storage_offset());
  Tensor c = contiguous(t);
  Shape cst = contiguous_strides(s);
  return detail::make_view(c, std::move(s), std::move(cst), c.storage_offset());
}

Tensor permute(const Tensor& t, const Shape& dims) {
  CHORUS_CHECK(static_cast<int64_t>(dims.size()) == t.dim(), "permute: ", dims.size(),
               " dims given for a tensor of ", t.dim(), " dims");
  Shape sizes(dims.size()), strides(dims.size());
  std::vector<bool> used(dims.size(), false);
  for (size_t i = 0; i < dims.size(); ++i) {
    int64_t d = wrap_dim(dims[i], t.dim(), "permute");
    CHORUS_CHECK(!used[d], "permute: dim ", d, " repeated in ", shape_str(dims));
    used[d] = true;
    sizes[i] = t.size(d);
    strides[i] = t.stride(d);
  }
  return detail::make_view(t, std::move(sizes), std::move(strides), t.storage_offset());
}

Tensor slice(const Tensor& t, int64_t dim, int64_t start, int64_t end, int64_t step) {
  dim = wrap_dim(dim, t.dim(), "slice");
  CHORUS_CHECK(step > 0, "slice: step must be positive, got ", step);
  int64_t n = t.size(dim);
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<int64_t>(start, 0, n);
  end = std::clamp<int64_t>(end, start, n);
  Shape sizes = t.sizes(), strides = t.strides();
  sizes[dim] = (end - start + step - 1) / step;
  strides[dim] *= step;
  const int64_t offset = t.storage_offset() + start * t.stride(dim);
  return detail::make_view(t, std::move(sizes), std::move(strides), offset);
}

Tensor select(const Tensor& t, int64_t dim, int64_t index) {
  dim = wrap_dim(dim, t.dim(), "select");
  int64_t n = t.size(dim);
  CHORUS_CHECK(index >= -n && index < n, "select: index ", index, " is out of range for dim ", dim,
               " of size ", n);
  if (index < 0) index += n;
  Shape sizes = t.sizes(), strides = t.strides();
  sizes.erase(sizes.begin() + dim);
  strides.erase(strides.begin() + dim);
  const int64_t offset = t.storage_offset() + index * t.stride(dim);
  return detail::make_view(t, std::move(sizes), std::move(strides), offset);
}

Tensor expand(const Tensor& t, const Shape& shape) {
  CHORUS_CHECK(static_cast<int64_t>(shape.size()) >= t.dim(), "expand: cannot expand ",
               shape_str(t.sizes()), " to fewer dims ", shape_str(shape));
  Shape sizes(shape.size()), strides(shape.size(), 0);
  int64_t lead = static_cast<int64_t>(shape.size()) - t.dim();
  for (int64_t i = 0; i < static_cast<int64_t>(shape.size()); ++i) {
    int64_t want = shape[i];
    if (i < lead) {
      CHORUS_CHECK(want >= 0, "expand: size -1 not allowed in a new leading dim");
      sizes[i] = want;
      continue;
    }
    int64_t have = t.size(i - lead);
    if (want == -1) want = have;
    CHORUS_CHECK(have == want || have == 1, "expand: cannot expand ", shape_str(t.sizes()), " to ",
                 shape_str(shape), " (dim ", i, ": ", have, " to ", want, ")");
    sizes[i] = want;
    strides[i] = have == want ? t.stride(i - lead) : 0;
  }
  return detail::make_view(t, std::move(sizes), std::move(strides), t.storage_offset());
}

Tensor squeeze(const Tensor& t, int64_t dim) {
  dim = wrap_dim(dim, t.dim(), "squeeze");
  // Always a fresh view, never `t` itself: the differentiable squeeze records
  // its grad_fn on the result, which must not turn a leaf into a non-leaf.
  if (t.size(dim) != 1) return detail::make_view(t, t.sizes(), t.strides(), t.storage_offset());
  Shape sizes = t.sizes(), strides = t.strides();
  sizes.erase(sizes.begin() + dim);
  strides.erase(strides.begin() + dim);
  return detail::make_view(t, std::move(sizes), std::move(strides), t.storage_offset());
}

Tensor unsqueeze(const Tensor& t, int64_t dim) {
  dim = wrap_dim(dim, t.dim() + 1, "unsqueeze");
  Shape sizes = t.sizes(), strides = t.strides();
  int64_t st = dim < t.dim() ? t.stride(dim) * t.size(dim) : 1;
  sizes.insert(sizes.begin() + dim, 1);
  strides.insert(strides.begin() + dim, st);
  return detail::make_view(t, std::move(sizes), std::move(strides), t.storage_offset());
}

}  // namespace chorus::ops
