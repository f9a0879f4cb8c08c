#include "chorus/core/env_switches.h"
#include "chorus/ops/copy.h"
#include "chorus/core/warn.h"

#include <atomic>
#include <cstdint>
#include <cstdlib>

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

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

namespace {
std::atomic<int> g_param_copy{-1};  // -1: not read from the environment yet
}  // namespace

void set_parameter_copy_policy(ParameterCopy policy) { g_param_copy.store(static_cast<int>(policy)); }

ParameterCopy parameter_copy_policy() {
  int p = g_param_copy.load();
  if (p < 0) {
    const char* e = chorus::env::get("CHORUS_STRICT_PLACEMENT");
    p = static_cast<int>(e && std::string(e) == "1" ? ParameterCopy::Error : ParameterCopy::Warn);
    int expected = -1;
    g_param_copy.compare_exchange_strong(expected, p);
    p = g_param_copy.load();
  }
  return static_cast<ParameterCopy>(p);
}

Tensor operand_to_device(const Tensor& t, const Device& d) {
  if (t.defined() && t.device() != d && t.is_leaf() && t.requires_grad()) {
    const ParameterCopy policy = parameter_copy_policy();
    if (policy != ParameterCopy::Allow) {
      const AutogradMeta* m = t.autograd_meta();
      const std::string what = (m && !m->label.empty() ? "parameter " + m->label + " " : "a trainable tensor ") +
                               t.describe();
      const std::string msg = what + " lives on " + t.device().str() + " but an op on " + d.str() +
                              " uses it, so it is copied there (and its gradient back) on every use; move the "
                              "op's other operands to " + t.device().str() + ", or the parameter to " + d.str();
      CHORUS_CHECK(policy != ParameterCopy::Error, msg, " (CHORUS_STRICT_PLACEMENT)");
      warn_once("parameter-copy:" + std::to_string(reinterpret_cast<uintptr_t>(t.impl())) + ":" + d.str(),
                msg + " (CHORUS_STRICT_PLACEMENT=1 makes this an error)");
    }
  }
  return to_device(t, d);
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

void copy_multi(const TensorList& srcs, const TensorList& dsts) {
  // Host time matters here (Note [Multi-tensor copy]): no view is made for a
  // pair that is contiguous already, and the common layouts skip the sort in
  // same_dense_layout.
  CHORUS_CHECK(srcs.size() == dsts.size(), "copy_multi: ", srcs.size(), " sources but ",
               dsts.size(), " destinations");
  struct Batch {
    Device device;
    TensorList srcs, dsts;
    std::vector<size_t> pairs;  // indices into the arguments
  };
  std::vector<Batch> batches;  // the pairs copied together, per device (usually one)
  std::vector<size_t> others;  // the pairs that take copy_
  for (size_t i = 0; i < srcs.size(); ++i) {
    const Tensor& s = srcs[i];
    const Tensor& d = dsts[i];
    CHORUS_CHECK(s.defined() && d.defined(), "copy_multi: pair ", i, " has an undefined ",
                 s.defined() ? "destination" : "source");
    CHORUS_CHECK(s.sizes() == d.sizes() && s.dtype() == d.dtype(), "copy_multi: pair ", i, " copies ",
                 s.describe(), " into ", d.describe(),
                 "; each pair needs one shape and one dtype (use copy_ to broadcast or convert)");
    if (d.numel() == 0) continue;
    const Device dev = d.device();
    // Two contiguous tensors of one shape are laid out alike; other dense
    // layouts go through flat views (Note [Dense tensors are flat]).
    const bool contiguous = s.is_contiguous() && d.is_contiguous();
    if (s.device() != dev || (!contiguous && !same_dense_layout({&s, &d}))) {
      others.push_back(i);
      continue;
    }
    Batch* b = nullptr;
    for (Batch& x : batches)
      if (x.device == dev) b = &x;
    if (!b) {
      batches.push_back(Batch{dev, {}, {}, {}});
      b = &batches.back();
      b->srcs.reserve(srcs.size() - i);
      b->dsts.reserve(srcs.size() - i);
      b->pairs.reserve(srcs.size() - i);
    }
    b->srcs.push_back(contiguous ? s : flat_view(s));
    b->dsts.push_back(contiguous ? d : flat_view(d));
    b->pairs.push_back(i);
  }
  // Overlaps within a batch: its kernel copies the pairs in no order. Checked
  // for all of them before anything is copied.
  struct Span {
    uintptr_t begin, end;
    size_t pair;
  };
  std::vector<Span> src_spans, dst_spans;
  for (const Batch& b : batches) {
    src_spans.clear();
    dst_spans.clear();
    for (size_t j = 0; j < b.pairs.size(); ++j) {
      const auto s = reinterpret_cast<uintptr_t>(b.srcs[j].raw_data());
      const auto d = reinterpret_cast<uintptr_t>(b.dsts[j].raw_data());
      const uintptr_t n = b.dsts[j].nbytes();
      if (s == d) continue;  // skipped by the kernel
      CHORUS_CHECK(s + n <= d || d + n <= s, "copy_multi: the destination of pair ", b.pairs[j],
                   " overlaps its source (", dsts[b.pairs[j]].describe(), ")");
      src_spans.push_back({s, s + n, b.pairs[j]});
      dst_spans.push_back({d, d + n, b.pairs[j]});
    }
    auto by_begin = [](const Span& x, const Span& y) { return x.begin < y.begin; };
    if (!std::is_sorted(dst_spans.begin(), dst_spans.end(), by_begin))  // packing: usually in order
      std::sort(dst_spans.begin(), dst_spans.end(), by_begin);
    for (size_t j = 1; j < dst_spans.size(); ++j)
      CHORUS_CHECK(dst_spans[j - 1].end <= dst_spans[j].begin, "copy_multi: the destinations of pairs ",
                   std::min(dst_spans[j - 1].pair, dst_spans[j].pair), " and ",
                   std::max(dst_spans[j - 1].pair, dst_spans[j].pair), " overlap");
    // The destinations are disjoint and sorted, so their ends are sorted too:
    // the first one that ends after a source begins is the only candidate.
    for (const Span& src : src_spans) {
      auto it = std::lower_bound(dst_spans.begin(), dst_spans.end(), src.begin,
                                 [](const Span& x, uintptr_t v) { return x.end <= v; });
      CHORUS_CHECK(it == dst_spans.end() || it->begin >= src.end, "copy_multi: the destination of pair ",
                   it->pair, " overlaps the source of pair ", src.pair);
    }
  }
  for (const Batch& b : batches) CHORUS_KERNEL(b.device, copy_multi, b.srcs, b.dsts);
  for (size_t i : others) copy_(dsts[i], srcs[i]);
  for (const Batch& b : batches)
    for (size_t i : b.pairs) dsts[i].bump_version();
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

bool same_dense_layout(std::initializer_list<const Tensor*> ts) {
  // On every op's host path: no allocation (an initializer list, and the
  // (stride, size) pairs on the stack for up to 8 dimensions).
  const Tensor& t0 = **ts.begin();
  for (const Tensor* t : ts)
    if (t->sizes() != t0.sizes() || t->strides() != t0.strides()) return false;
  if (t0.is_contiguous()) return true;
  const int64_t nd = t0.dim();
  std::array<std::pair<int64_t, int64_t>, 8> small;
  std::vector<std::pair<int64_t, int64_t>> large;
  std::pair<int64_t, int64_t>* dims = small.data();
  if (nd > static_cast<int64_t>(small.size())) {
    large.resize(static_cast<size_t>(nd));
    dims = large.data();
  }
  int64_t n = 0;  // (stride, size), size-1 dims skipped
  for (int64_t d = 0; d < nd; ++d)
    if (t0.size(d) != 1) dims[n++] = {t0.stride(d), t0.size(d)};
  std::sort(dims, dims + n);
  int64_t expected = 1;
  for (int64_t i = 0; i < n; ++i) {
    if (dims[i].first != expected) return false;
    expected *= dims[i].second;
  }
  return true;
}

Tensor flat_view(const Tensor& t) {
  // Already flat: the tensor itself (no view to allocate on the op's host path).
  if (t.dim() == 1 && t.stride(0) == 1) return t;
  return detail::make_view(t, Shape{t.numel()}, Shape{1}, t.storage_offset());
}

Tensor empty_with_layout(const Shape& s, DType dt, Device dev, bool channels_last) {
  if (channels_last && s.size() == 4)  // NHWC memory, one tensor (no view over an NHWC-shaped one)
    return detail::empty_dense_strided(Shape(s), {s[1] * s[2] * s[3], 1, s[3] * s[1], s[1]}, dt, dev);
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
