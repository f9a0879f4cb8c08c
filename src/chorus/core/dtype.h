// Element types. bfloat16 is stored as 16 bits and computed in float on the CPU.
#pragma once

#include <cstdint>
#include <cstring>
#include <ostream>
#include <string>

namespace chorus {

// Float64 is a CPU-side extension to DESIGN.md's list: gradient checks run in
// double against finite differences.
enum class DType : int8_t { Float32, BFloat16, Float16, Int64, Int32, UInt8, Bool, Float64 };

constexpr DType kFloat32 = DType::Float32;
constexpr DType kBFloat16 = DType::BFloat16;
constexpr DType kFloat16 = DType::Float16;
constexpr DType kInt64 = DType::Int64;
constexpr DType kInt32 = DType::Int32;
constexpr DType kUInt8 = DType::UInt8;
constexpr DType kBool = DType::Bool;
constexpr DType kFloat64 = DType::Float64;

size_t dtype_size(DType t);
const char* dtype_name(DType t);    // "float32", "bfloat16", ...
DType parse_dtype(const std::string& name);
bool is_floating(DType t);
inline std::ostream& operator<<(std::ostream& os, DType t) { return os << dtype_name(t); }

// bfloat16: the upper half of an IEEE float, rounded to nearest even.
struct BFloat16 {
  uint16_t bits = 0;
  BFloat16() = default;
  explicit BFloat16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays a (quiet) NaN
      bits = static_cast<uint16_t>((u >> 16) | 0x40);
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);
      bits = static_cast<uint16_t>(u >> 16);
    }
  }
  operator float() const {
    uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

// IEEE half, converted in software on the CPU (GPU kernels use native types).
struct Float16 {
  uint16_t bits = 0;
  Float16() = default;
  explicit Float16(float f);
  operator float() const;
};

}  // namespace chorus
