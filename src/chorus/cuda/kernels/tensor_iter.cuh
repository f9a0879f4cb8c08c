// Strided iteration for CUDA kernels: the geometry of N operands viewed over
// one shape, collapsed on the host, and the device-side map from a linear
// (row-major) element index to each operand's element offset.
//
// Collapsing drops size-1 dims and merges neighbours that every operand
// traverses as one (stride[d] == stride[d+1] * size[d+1]), so a contiguous
// tensor becomes one dim, a transposed matrix stays two, and the div/mod work
// per element is as small as the geometry allows.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>

#include "chorus/core/error.h"
#include "chorus/core/shape.h"

namespace chorus::cuda {

constexpr int kMaxDims = 12;

// V elements of T as one aligned unit: one 16-byte load or store for V * sizeof(T) = 16.
template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};
constexpr int kThreads = 256;

template <int N>
struct Offsets {
  int64_t v[N];
};

template <int N>
struct OffsetCalc {
  int ndim = 0;
  bool narrow = true;            // every index < 2^32: divide in 32 bits
  int64_t sizes[kMaxDims];       // innermost dim first
  int64_t strides[kMaxDims][N];  // in elements, per dim per operand

  // True when every operand walks the elements in order with stride 1.
  bool contiguous() const {
    if (ndim == 0) return true;
    if (ndim > 1) return false;
    for (int k = 0; k < N; ++k)
      if (strides[0][k] != 1) return false;
    return true;
  }

  __device__ __forceinline__ Offsets<N> get(int64_t linear) const {
    Offsets<N> off;
#pragma unroll
    for (int k = 0; k < N; ++k) off.v[k] = 0;
    if (narrow) {
      uint32_t idx = static_cast<uint32_t>(linear);
#pragma unroll
      for (int d = 0; d < kMaxDims; ++d) {
        if (d == ndim) break;
        const uint32_t s = static_cast<uint32_t>(sizes[d]);
        const uint32_t q = idx / s;
        const int64_t c = static_cast<int64_t>(idx - q * s);
        idx = q;
#pragma unroll
        for (int k = 0; k < N; ++k) off.v[k] += c * strides[d][k];
      }
    } else {
      int64_t idx = linear;
#pragma unroll
      for (int d = 0; d < kMaxDims; ++d) {
        if (d == ndim) break;
        const int64_t q = idx / sizes[d];
        const int64_t c = idx - q * sizes[d];
        idx = q;
#pragma unroll
        for (int k = 0; k < N; ++k) off.v[k] += c * strides[d][k];
      }
    }
    return off;
  }
};

// The collapsed geometry of N operands with the given strides over `sizes`.
template <int N>
OffsetCalc<N> make_offset_calc(const Shape& sizes, const std::array<Shape, N>& strides) {
  OffsetCalc<N> calc;
  int64_t numel = 1;
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
    const int64_t size = sizes[static_cast<size_t>(d)];
    numel *= size;
    if (size == 1) continue;
    bool merge = calc.ndim > 0;
    for (int k = 0; k < N && merge; ++k) {
      const int64_t inner = calc.strides[calc.ndim - 1][k] * calc.sizes[calc.ndim - 1];
      merge = strides[k][static_cast<size_t>(d)] == inner;
    }
    if (merge) {
      calc.sizes[calc.ndim - 1] *= size;
      continue;
    }
    CHORUS_CHECK(calc.ndim < kMaxDims, "CUDA kernels support views of at most ", kMaxDims,
                 " non-mergeable dims; got shape ", shape_str(sizes), " (call .contiguous() first)");
    calc.sizes[calc.ndim] = size;
    for (int k = 0; k < N; ++k) calc.strides[calc.ndim][k] = strides[k][static_cast<size_t>(d)];
    ++calc.ndim;
  }
  calc.narrow = numel <= static_cast<int64_t>(UINT32_MAX);
  return calc;
}

// Blocks for `items` work items of kThreads threads each (grid-stride loops
// cover anything beyond the cap).
inline unsigned grid_for(int64_t items, int threads = kThreads) {
  const int64_t blocks = (items + threads - 1) / threads;
  return static_cast<unsigned>(std::clamp<int64_t>(blocks, 1, int64_t{1} << 20));
}

__device__ __forceinline__ int64_t global_thread_id() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_stride() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

}  // namespace chorus::cuda
