#include "chorus/core/dtype.h"

#include "chorus/core/error.h"

namespace chorus {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::Float32: return 4;
    case DType::BFloat16: return 2;
    case DType::Float16: return 2;
    case DType::Int64: return 8;
    case DType::Int32: return 4;
    case DType::UInt8: return 1;
    case DType::Bool: return 1;
    case DType::Float64: return 8;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::Float32: return "float32";
    case DType::BFloat16: return "bfloat16";
    case DType::Float16: return "float16";
    case DType::Int64: return "int64";
    case DType::Int32: return "int32";
    case DType::UInt8: return "uint8";
    case DType::Bool: return "bool";
    case DType::Float64: return "float64";
  }
  return "?";
}

DType parse_dtype(const std::string& n) {
  if (n == "float32" || n == "fp32" || n == "F32") return kFloat32;
  if (n == "bfloat16" || n == "bf16" || n == "BF16") return kBFloat16;
  if (n == "float16" || n == "fp16" || n == "F16") return kFloat16;
  if (n == "int64" || n == "I64") return kInt64;
  if (n == "int32" || n == "I32") return kInt32;
  if (n == "uint8" || n == "U8") return kUInt8;
  if (n == "bool" || n == "BOOL") return kBool;
  if (n == "float64" || n == "fp64" || n == "F64") return kFloat64;
  CHORUS_THROW(ValueError, "unknown dtype '", n,
               "' (expected float32, bfloat16, float16, int64, int32, uint8 or bool)");
}

bool is_floating(DType t) {
  return t == kFloat32 || t == kBFloat16 || t == kFloat16 || t == kFloat64;
}

Float16::Float16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  int32_t exp = static_cast<int32_t>((x >> 23) & 0xff) - 127 + 15;
  uint32_t mant = x & 0x7fffffu;
  if (((x >> 23) & 0xff) == 0xff) {  // inf / nan
    bits = static_cast<uint16_t>(sign | 0x7c00u | (mant ? 0x200u : 0));
  } else if (exp >= 31) {
    bits = static_cast<uint16_t>(sign | 0x7c00u);
  } else if (exp <= 0) {
    if (exp < -10) {
      bits = static_cast<uint16_t>(sign);
    } else {
      mant |= 0x800000u;
      uint32_t shift = static_cast<uint32_t>(14 - exp);
      uint32_t half = mant >> shift;
      uint32_t rem = mant & ((1u << shift) - 1);
      uint32_t mid = 1u << (shift - 1);
      if (rem > mid || (rem == mid && (half & 1))) ++half;
      bits = static_cast<uint16_t>(sign | half);
    }
  } else {
    uint32_t half = sign | (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
    uint32_t rem = mant & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (half & 1))) ++half;
    bits = static_cast<uint16_t>(half);
  }
}

Float16::operator float() const {
  uint32_t sign = (bits & 0x8000u) << 16;
  uint32_t exp = (bits >> 10) & 0x1f;
  uint32_t mant = bits & 0x3ffu;
  uint32_t out;
  if (exp == 0) {
    if (mant == 0) {
      out = sign;
    } else {
      exp = 127 - 15 + 1;
      while (!(mant & 0x400u)) { mant <<= 1; --exp; }
      mant &= 0x3ffu;
      out = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    out = sign | 0x7f800000u | (mant << 13);
  } else {
    out = sign | ((exp - 15 + 127) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &out, 4);
  return f;
}

}  // namespace chorus
