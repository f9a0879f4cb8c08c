// Dtype dispatch for CPU kernels: CHORUS_CPU_DISPATCH(dtype, T, body) runs
// `body` with T bound to the element type. Floating types compute in float
// (ComputeT<T>), integers in double (exact for the ranges Chorus uses).
#pragma once

#include <cstdint>
#include <type_traits>

#include "chorus/core/dtype.h"
#include "chorus/core/error.h"

namespace chorus::cpu {

template <typename T>
using ComputeT = std::conditional_t<std::is_same_v<T, float> || std::is_same_v<T, BFloat16> ||
                                        std::is_same_v<T, Float16>,
                                    float, double>;

template <typename T, typename C>
inline T from_compute(C v) {
  if constexpr (std::is_same_v<T, bool>) return v != C(0);
  else if constexpr (std::is_same_v<T, BFloat16> || std::is_same_v<T, Float16>) return T(static_cast<float>(v));
  else return static_cast<T>(v);
}

template <typename T>
inline ComputeT<T> to_compute(T v) {
  return static_cast<ComputeT<T>>(v);
}

}  // namespace chorus::cpu

#define CHORUS_CPU_DISPATCH(DT, T, ...)                                              \
  switch (DT) {                                                                      \
    case ::chorus::kFloat32: { using T = float; __VA_ARGS__; break; }                \
    case ::chorus::kBFloat16: { using T = ::chorus::BFloat16; __VA_ARGS__; break; }  \
    case ::chorus::kFloat16: { using T = ::chorus::Float16; __VA_ARGS__; break; }    \
    case ::chorus::kInt64: { using T = int64_t; __VA_ARGS__; break; }                \
    case ::chorus::kInt32: { using T = int32_t; __VA_ARGS__; break; }                \
    case ::chorus::kUInt8: { using T = uint8_t; __VA_ARGS__; break; }                \
    case ::chorus::kBool: { using T = bool; __VA_ARGS__; break; }                    \
    case ::chorus::kFloat64: { using T = double; __VA_ARGS__; break; }               \
  }
