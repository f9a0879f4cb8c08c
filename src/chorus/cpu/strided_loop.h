// Strided iteration over several same-shaped operands (output first). Dims that
// are contiguous in every operand are merged first, so a contiguous or simply
// broadcast case becomes one inner loop. Used by the elementwise kernels.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "chorus/core/tensor.h"
#include "chorus/cpu/parallel.h"

namespace chorus::cpu {

template <size_t N>
struct StridedGeometry {
  std::vector<int64_t> sizes;                     // merged, outermost first
  std::array<std::vector<int64_t>, N> strides;    // in elements
  std::array<char*, N> base;
  std::array<int64_t, N> elsize;
};

template <size_t N>
StridedGeometry<N> make_geometry(const std::array<const Tensor*, N>& ops) {
  StridedGeometry<N> g;
  const Shape& sizes = ops[0]->sizes();
  for (size_t k = 0; k < N; ++k) {
    g.base[k] = static_cast<char*>(ops[k]->raw_data());
    g.elsize[k] = static_cast<int64_t>(ops[k]->element_size());
  }
  // Drop size-1 dims, then merge dim i into the next when contiguous in all.
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 1) continue;
    bool merge = !g.sizes.empty();
    for (size_t k = 0; k < N && merge; ++k)
      merge = g.strides[k].back() == ops[k]->strides()[d] * sizes[d];
    if (merge) {
      g.sizes.back() *= sizes[d];
      for (size_t k = 0; k < N; ++k) g.strides[k].back() = ops[k]->strides()[d];
    } else {
      g.sizes.push_back(sizes[d]);
      for (size_t k = 0; k < N; ++k) g.strides[k].push_back(ops[k]->strides()[d]);
    }
  }
  if (g.sizes.empty()) {
    g.sizes.push_back(1);
    for (size_t k = 0; k < N; ++k) g.strides[k].push_back(0);
  }
  return g;
}

// Calls fn(ptrs, inner_strides_in_bytes, count) for each run of the innermost
// dim; rows of the outer dims are spread over threads.
template <size_t N, typename F>
void strided_for_each(const std::array<const Tensor*, N>& ops, F&& fn) {
  StridedGeometry<N> g = make_geometry<N>(ops);
  const int64_t nd = static_cast<int64_t>(g.sizes.size());
  const int64_t inner = g.sizes[nd - 1];
  int64_t outer = 1;
  for (int64_t d = 0; d + 1 < nd; ++d) outer *= g.sizes[d];
  std::array<int64_t, N> inner_bytes;
  for (size_t k = 0; k < N; ++k) inner_bytes[k] = g.strides[k][nd - 1] * g.elsize[k];
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(inner, 1));
  auto run_rows = [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      std::array<char*, N> p = g.base;
      int64_t rem = row;
      for (int64_t d = nd - 2; d >= 0; --d) {
        int64_t idx = rem % g.sizes[d];
        rem /= g.sizes[d];
        for (size_t k = 0; k < N; ++k) p[k] += idx * g.strides[k][d] * g.elsize[k];
      }
      fn(p, inner_bytes, inner);
    }
  };
  if (outer == 1 && inner >= 65536) {
    // One long run: split it.
    parallel_for(inner, 32768, [&](int64_t b, int64_t e) {
      std::array<char*, N> p = g.base;
      for (size_t k = 0; k < N; ++k) p[k] += b * inner_bytes[k];
      fn(p, inner_bytes, e - b);
    });
  } else {
    parallel_for(outer, grain, run_rows);
  }
}

}  // namespace chorus::cpu
