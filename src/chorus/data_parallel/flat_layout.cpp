#include "chorus/data_parallel/flat_layout.h"

#include <algorithm>

#include "chorus/core/error.h"
#include "chorus/ops/copy.h"

namespace chorus::dist {

FlatLayout::FlatLayout(const std::vector<Tensor>& ts, const std::vector<DType>& as) {
  CHORUS_CHECK(as.empty() || as.size() == ts.size(), "flat layout: ", as.size(), " dtypes for ", ts.size(),
               " tensors");
  for (size_t i = 0; i < ts.size(); ++i) {
    const Tensor& t = ts[i];
    const DType dt = as.empty() ? t.dtype() : as[i];
    size_t g = 0;
    while (g < dtypes.size() && dtypes[g] != dt) ++g;
    if (g == dtypes.size()) {
      dtypes.push_back(dt);
      numels.push_back(0);
    }
    const int64_t align = std::max<int64_t>(1, kAlignBytes / static_cast<int64_t>(dtype_size(dt)));
    Segment s;
    s.group = g;
    s.offset = (numels[g] + align - 1) / align * align;
    s.sizes = t.sizes();
    s.strides = ops::same_dense_layout({&t}) ? t.strides() : contiguous_strides(t.sizes());
    numels[g] = s.offset + t.numel();
    segments.push_back(std::move(s));
  }
}

Tensor FlatLayout::view(const Tensor& flat, size_t i) const {
  const Segment& s = segments[i];
  Tensor v = chorus::detail::make_view(flat, s.sizes, s.strides, flat.storage_offset() + s.offset);
  v.impl()->version = std::make_shared<uint32_t>(0);
  return v;
}

bool FlatLayout::matches(size_t i, const Tensor& t) const {
  return t.sizes() == segments[i].sizes && t.dtype() == dtypes[segments[i].group];
}

}  // namespace chorus::dist
