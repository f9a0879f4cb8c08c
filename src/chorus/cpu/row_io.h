// Row loads and stores in a compute type, shared by the row-wise CPU kernels
// (softmax, cross entropy, layer norm, attention's softmax): each row is
// converted into a scratch buffer of C, computed there and stored back, so
// one code path serves every floating dtype in any mix of inputs and outputs.
// C is float (the kernel-set rule, what the CUDA kernels do), or double when
// any operand is float64: the CPU-only float64 exists for gradient checks,
// which float math would spoil.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "chorus/core/error.h"
#include "chorus/core/tensor.h"

namespace chorus::cpu {

// t's elements [first, first + n) converted to C (t is a checked float tensor).
template <typename C>
inline void load_row(const Tensor& t, int64_t first, int64_t n, C* dst) {
  auto load = [&](auto tag) {
    using T = decltype(tag);
    const T* p = t.data<T>() + first;
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<C>(static_cast<float>(p[i]));
  };
  switch (t.dtype()) {
    case kFloat32: return load(float{});
    case kBFloat16: return load(BFloat16{});
    case kFloat16: return load(Float16{});
    case kFloat64: {
      const double* p = t.data<double>() + first;
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<C>(p[i]);
      return;
    }
    default: CHORUS_ASSERT(false && "load_row: not a floating dtype");
  }
}

template <typename C>
inline void store_row(const C* src, const Tensor& t, int64_t first, int64_t n) {
  auto store = [&](auto tag) {
    using T = decltype(tag);
    T* p = t.data<T>() + first;
    for (int64_t i = 0; i < n; ++i) p[i] = T(static_cast<float>(src[i]));
  };
  switch (t.dtype()) {
    case kFloat32: return store(float{});
    case kBFloat16: return store(BFloat16{});
    case kFloat16: return store(Float16{});
    case kFloat64: {
      double* p = t.data<double>() + first;
      for (int64_t i = 0; i < n; ++i) p[i] = static_cast<double>(src[i]);
      return;
    }
    default: CHORUS_ASSERT(false && "store_row: not a floating dtype");
  }
}

// Runs f(C{}) with C = double if any tensor is float64, else float.
template <typename F>
inline void with_compute_type(std::initializer_list<const Tensor*> ts, F&& f) {
  for (const Tensor* t : ts) {
    if (t->dtype() == kFloat64) return f(double{});
  }
  f(float{});
}

}  // namespace chorus::cpu
