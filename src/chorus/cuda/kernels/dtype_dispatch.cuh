// Device element types for Chorus dtypes, conversions between them, and the
// dispatch from a runtime DType to a kernel templated on the element type.
//
// Math runs in acc_t: float for the floating dtypes, double for integers and
// bool, as on the CPU (cpu/dtype_dispatch.h ComputeT), so both devices round alike.
// Dispatch takes a C++20 templated lambda: dispatch_all(t, "op", [&]<typename T>() {...}).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "chorus/core/dtype.h"
#include "chorus/core/error.h"

namespace chorus::cuda {

using bf16 = __nv_bfloat16;
using fp16 = __half;

template <typename T>
inline constexpr bool is_half_v = std::is_same_v<T, bf16> || std::is_same_v<T, fp16>;
template <typename T>
inline constexpr bool is_float_v = std::is_same_v<T, float> || is_half_v<T>;
template <typename T>
using acc_t = std::conditional_t<is_float_v<T>, float, double>;

// Value conversion between element types, as static_cast would do for
// built-in types (bool: nonzero is true); the 16-bit floats round to nearest
// even through float.
template <typename To, typename From>
__host__ __device__ __forceinline__ To convert(From v) {
  if constexpr (std::is_same_v<To, From>) {
    return v;
  } else if constexpr (std::is_same_v<From, bf16>) {
    return convert<To>(__bfloat162float(v));
  } else if constexpr (std::is_same_v<From, fp16>) {
    return convert<To>(__half2float(v));
  } else if constexpr (std::is_same_v<To, bf16>) {
    return __float2bfloat16_rn(static_cast<float>(v));
  } else if constexpr (std::is_same_v<To, fp16>) {
    return __float2half_rn(static_cast<float>(v));
  } else if constexpr (std::is_same_v<To, bool>) {
    return v != From(0);
  } else {
    return static_cast<To>(v);
  }
}

template <typename T>
__device__ __forceinline__ acc_t<T> to_acc(T v) {
  return convert<acc_t<T>>(v);
}

#define CHORUS_DTYPE_CASE(dtype, type) \
  case dtype:                          \
    f.template operator()<type>();     \
    break;

// Every dtype.
template <typename F>
void dispatch_all(DType t, const char* op, F&& f) {
  switch (t) {
    CHORUS_DTYPE_CASE(DType::Float32, float)
    CHORUS_DTYPE_CASE(DType::BFloat16, bf16)
    CHORUS_DTYPE_CASE(DType::Float16, fp16)
    CHORUS_DTYPE_CASE(DType::Int64, int64_t)
    CHORUS_DTYPE_CASE(DType::Int32, int32_t)
    CHORUS_DTYPE_CASE(DType::UInt8, uint8_t)
    CHORUS_DTYPE_CASE(DType::Bool, bool)
    default:
      CHORUS_THROW(ValueError, op, ": unsupported dtype ", dtype_name(t), " on CUDA");
  }
}

// float32, bfloat16, float16.
template <typename F>
void dispatch_float(DType t, const char* op, F&& f) {
  switch (t) {
    CHORUS_DTYPE_CASE(DType::Float32, float)
    CHORUS_DTYPE_CASE(DType::BFloat16, bf16)
    CHORUS_DTYPE_CASE(DType::Float16, fp16)
    default:
      CHORUS_THROW(ValueError, op, ": expected a floating-point tensor (float32, bfloat16 or "
                   "float16), got ", dtype_name(t));
  }
}

// Every dtype but bool (arithmetic that bool does not have).
template <typename F>
void dispatch_numeric(DType t, const char* op, F&& f) {
  if (t == DType::Bool) {
    CHORUS_THROW(ValueError, op, ": not supported for bool tensors");
  }
  dispatch_all(t, op, static_cast<F&&>(f));
}

// Same-size unsigned integer type: for kernels that only move elements.
template <typename F>
void dispatch_by_size(DType t, F&& f) {
  switch (dtype_size(t)) {
    case 1: f.template operator()<uint8_t>(); break;
    case 2: f.template operator()<uint16_t>(); break;
    case 4: f.template operator()<uint32_t>(); break;
    case 8: f.template operator()<uint64_t>(); break;
    default: CHORUS_THROW(Error, "internal error: element size ", dtype_size(t));
  }
}

#undef CHORUS_DTYPE_CASE

}  // namespace chorus::cuda
