// FlatLayout: where each of a list of tensors lives in one flat buffer per
// dtype. DataParallel moves parameters to its replicas, and the gradient
// reducer moves gradients, as these buffers: one collective per buffer instead
// of one copy per tensor (a ResNet has ~100 parameters; per-tensor host work,
// issued from one thread, is what limits scaling).
#pragma once

#include <cstdint>
#include <vector>

#include "chorus/core/tensor.h"

namespace chorus::dist {

struct FlatLayout {
  // Segments start on 128-byte boundaries, so that every view is as aligned as
  // a fresh tensor (vectorised kernels, NCCL).
  static constexpr int64_t kAlignBytes = 128;

  struct Segment {
    size_t group = 0;    // index into dtypes / numels
    int64_t offset = 0;  // elements from the start of the group's buffer
    Shape sizes, strides;
  };
  std::vector<DType> dtypes;      // [group]: one flat buffer per dtype
  std::vector<int64_t> numels;    // [group]
  std::vector<Segment> segments;  // [tensor]

  FlatLayout() = default;
  // A dense layout (contiguous, channels-last, ...) is kept, so that packing is
  // a flat copy and a replica's convolution weights have the master's memory
  // format; anything else is stored contiguous.
  // `as`: the dtype each tensor's segment holds when not its own (ZeRO's
  // 16-bit gathered weights of float32 parameters); empty: their own.
  explicit FlatLayout(const std::vector<Tensor>& ts, const std::vector<DType>& as = {});

  size_t groups() const { return dtypes.size(); }
  // Tensor i's view of `flat` (the buffer of its group). The view has its own
  // version counter, as a separate tensor would: bumping one parameter's does
  // not mark its neighbours changed.
  Tensor view(const Tensor& flat, size_t i) const;
  bool matches(size_t i, const Tensor& t) const;
};

}  // namespace chorus::dist
