#include <algorithm>
#include "chorus/ops/copy.h"

#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/ops/dispatch.h"

namespace chorus::ops {

namespace {
// The kernel-set copy, on flat views where the layouts allow (Note [Dense tensors are flat]).
void copy_kernel(const Tensor& src, const Tensor& dst) {
  if (same_dense_layout({&src, &dst})) {
    CHORUS_KERNEL(dst.device(), copy, flat_view(src), flat_view(dst));
  } else {
    CHORUS_KERNEL(dst.device(), copy, src, dst);
  }
}
}  // namespace

Tensor contiguous(const Tensor& t) {
  detail::check_defined(t, "contiguous", "self");
  if (t.is_contiguous()) return t;
  Tensor out = detail::empty_tensor(t.sizes(), t.dtype(), t.device());
  CHORUS_KERNEL(t.device(), copy, t, out);
  return out;
}

Tensor clone(const Tensor& t) {
  detail::check_defined(t, "clone", "self");
  Tensor out = empty_like_layout(t, t.sizes(), t.dtype());
  copy_kernel(t, out);
  return out;
}

Tensor to_device(const Tensor& t, const Device& d) {
  detail::check_defined(t, "to", "self");
  if (t.device() == d) return t;
  check_device(d);
  // A dense channels-last tensor stays channels-last (PyTorch's
  // preserve_format): a DataParallel chunk of an NHWC batch must reach its
  // replica NHWC, or that replica's whole network runs in NCHW.
  const bool cl = is_channels_last(t) && same_dense_layout({&t});
  Tensor src = cl ? t : contiguous(t);
  Tensor out = empty_with_layout(src.sizes(), src.dtype(), d, cl);
  if (src.nbytes() == 0) return out;
  // The GPU side's backend does the copy (it knows both pointers' kinds).
  Device src_dev = src.device();
  DeviceBackend& b = backend(d.is_cuda() ? d : src_dev);
  b.copy(out.raw_data(), d, src.raw_data(), src_dev, src.nbytes());
  // The destination stream reads the source storage until the copy is done.
  backend(src_dev).record_use(src.storage()->data(), src_dev, d);
  return out;
}

Tensor to_dtype(const Tensor& t, DType dt) {
  detail::check_defined(t, "to", "self");
  if (t.dtype() == dt) return t;
  Tensor out = empty_like_layout(t, t.sizes(), dt);
  copy_kernel(t, out);
  return out;
}

void copy_(const Tensor& dst, const Tensor& src) {
  detail::check_defined(dst, "copy_", "self");
  detail::check_defined(src, "copy_", "src");
  Shape bs = broadcast_shapes(dst.sizes(), src.sizes(), "copy_");
  CHORUS_CHECK(bs == dst.sizes(), "copy_: source of shape ", shape_str(src.sizes()),
               " cannot be broadcast to destination shape ", shape_str(dst.sizes()));
  Tensor s = to_device(src, dst.device());
  // Broadcast view of the source with dst's shape.
  Shape strides(dst.dim(), 0);
  int64_t lead = dst.dim() - s.dim();
  for (int64_t i = 0; i < s.dim(); ++i)
    strides[lead + i] = s.size(i) == 1 ? 0 : s.stride(i);
  Tensor view = detail::make_view(s, dst.sizes(), strides, s.storage_offset());
  if (dst.numel() == 0) return;
  copy_kernel(view, dst);
  dst.bump_version();
}

void fill_(const Tensor& dst, double v) {
  detail::check_defined(dst, "fill_", "self");
  if (dst.numel() == 0) return;
  CHORUS_KERNEL(dst.device(), fill, dst, v);
  dst.bump_version();
}

double item(const Tensor& t) {
  detail::check_defined(t, "item", "self");
  CHORUS_CHECK(t.numel() == 1, "item: expected a tensor with one element, got ", t.describe());
  Tensor h = to_device(contiguous(t), cpu_device(0));
  if (h.dtype() != kFloat64 && h.dtype() != kInt64) h = to_dtype(h, is_floating(h.dtype()) ? kFloat64 : kInt64);
  if (h.dtype() == kInt64) return static_cast<double>(*h.data<int64_t>());
  return *h.data<double>();
}

bool is_channels_last(const Tensor& t) {
  if (t.dim() != 4) return false;
  const Shape& s = t.sizes();
  const Shape& st = t.strides();
  return st[1] == 1 && st[3] == s[1] && st[2] == s[1] * s[3] && (s[1] > 1 || s[2] * s[3] > 1);
}

bool same_dense_layout(const std::vector<const Tensor*>& ts) {
  const Tensor& t0 = *ts[0];
  for (const Tensor* t : ts)
    if (t->sizes() != t0.sizes() || t->strides() != t0.strides()) return false;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size), size-1 dims skipped
  for (int64_t d = 0; d < t0.dim(); ++d)
    if (t0.size(d) != 1) dims.push_back({t0.stride(d), t0.size(d)});
  std::sort(dims.begin(), dims.end());
  int64_t expected = 1;
  for (auto& [st, sz] : dims) {
    if (st != expected) return false;
    expected *= sz;
  }
  return true;
}

Tensor flat_view(const Tensor& t) { return detail::make_view(t, {t.numel()}, {1}, t.storage_offset()); }

Tensor empty_with_layout(const Shape& s, DType dt, Device dev, bool channels_last) {
  if (channels_last && s.size() == 4) {
    Tensor nhwc = detail::empty_tensor({s[0], s[2], s[3], s[1]}, dt, dev);
    return detail::make_view(nhwc, s, {s[1] * s[2] * s[3], 1, s[3] * s[1], s[1]}, 0);
  }
  return detail::empty_tensor(s, dt, dev);
}

Tensor empty_like_layout(const Tensor& t, const Shape& s, DType dt) {
  return empty_with_layout(s, dt, t.device(), s == t.sizes() && is_channels_last(t));
}

Tensor to_channels_last(const Tensor& t) {
  CHORUS_CHECK(t.dim() == 4, "to_channels_last: expected a 4-d tensor, got ", t.describe());
  if (is_channels_last(t)) return t;
  const Shape& s = t.sizes();
  Tensor nhwc = detail::empty_tensor({s[0], s[2], s[3], s[1]}, t.dtype(), t.device());
  Tensor view = detail::make_view(nhwc, s, {s[1] * s[2] * s[3], 1, s[3] * s[1], s[1]}, 0);
  CHORUS_KERNEL(t.device(), copy, t, view);
  return view;
}

}  // namespace chorus::ops
