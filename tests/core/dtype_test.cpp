// Element types: sizes and names, bfloat16 and float16 against known bit
// patterns (round to nearest, ties to even), and tensor dtype conversions.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include <chorus/chorus.h>

#include "testing/expect_error.h"

namespace chorus {
namespace {

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
uint16_t bf16_bits(float f) { return BFloat16(f).bits; }
uint16_t fp16_bits(float f) { return Float16(f).bits; }
float bf16_value(uint16_t bits) {
  BFloat16 b;
  b.bits = bits;
  return static_cast<float>(b);
}
float fp16_value(uint16_t bits) {
  Float16 h;
  h.bits = bits;
  return static_cast<float>(h);
}

TEST(DType, SizesNamesAndParsing) {
  EXPECT_EQ(dtype_size(kFloat32), 4u);
  EXPECT_EQ(dtype_size(kBFloat16), 2u);
  EXPECT_EQ(dtype_size(kFloat16), 2u);
  EXPECT_EQ(dtype_size(kInt64), 8u);
  EXPECT_EQ(dtype_size(kInt32), 4u);
  EXPECT_EQ(dtype_size(kUInt8), 1u);
  EXPECT_EQ(dtype_size(kBool), 1u);
  EXPECT_EQ(dtype_size(kFloat64), 8u);
  for (DType t : {kFloat32, kBFloat16, kFloat16, kInt64, kInt32, kUInt8, kBool, kFloat64})
    EXPECT_EQ(parse_dtype(dtype_name(t)), t) << dtype_name(t);
  EXPECT_EQ(parse_dtype("bf16"), kBFloat16);
  EXPECT_EQ(parse_dtype("fp32"), kFloat32);
  EXPECT_THROW(parse_dtype("float8"), ValueError);
  EXPECT_TRUE(test::throws_naming([] { parse_dtype("complex64"); }, {"complex64"}));
  EXPECT_TRUE(is_floating(kBFloat16));
  EXPECT_TRUE(is_floating(kFloat64));
  EXPECT_FALSE(is_floating(kInt32));
  EXPECT_FALSE(is_floating(kBool));
}

TEST(DType, BFloat16KnownBitPatterns) {
  EXPECT_EQ(bf16_bits(1.0f), 0x3F80);
  EXPECT_EQ(bf16_bits(-2.5f), 0xC020);
  EXPECT_EQ(bf16_bits(0.0f), 0x0000);
  EXPECT_EQ(bf16_bits(-0.0f), 0x8000);
  EXPECT_EQ(bf16_bits(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(bf16_bits(-std::numeric_limits<float>::infinity()), 0xFF80);
  EXPECT_EQ(bf16_bits(3.140625f), 0x4049);  // exactly representable
  EXPECT_EQ(bf16_bits(1.0f / 3.0f), 0x3EAB);  // 0x3EAAAAAB rounds up
}

TEST(DType, BFloat16RoundsToNearestEven) {
  // 1 + 2^-8 lies halfway between 0x3F80 (1.0) and 0x3F81: ties go to the even one.
  EXPECT_EQ(bf16_bits(from_bits(0x3F808000)), 0x3F80);
  // 1 + 3 * 2^-8 lies halfway between 0x3F81 and 0x3F82: to the even 0x3F82.
  EXPECT_EQ(bf16_bits(from_bits(0x3F818000)), 0x3F82);
  // Just above and below halfway.
  EXPECT_EQ(bf16_bits(from_bits(0x3F808001)), 0x3F81);
  EXPECT_EQ(bf16_bits(from_bits(0x3F807FFF)), 0x3F80);
  // Rounding that carries into the exponent: 0x3FFF8000 ties up to 2.0.
  EXPECT_EQ(bf16_bits(from_bits(0x3FFF8000)), 0x4000);
  // The largest float rounds to infinity, as IEEE round-to-nearest does.
  EXPECT_EQ(bf16_bits(std::numeric_limits<float>::max()), 0x7F80);
  // Subnormals round like everything else.
  EXPECT_EQ(bf16_bits(from_bits(0x00018000)), 0x0002);
  EXPECT_EQ(bf16_bits(from_bits(0x00008000)), 0x0000);
}

TEST(DType, BFloat16NanStaysNan) {
  EXPECT_TRUE(std::isnan(static_cast<float>(BFloat16(std::numeric_limits<float>::quiet_NaN()))));
  // A NaN whose payload sits only in the low half must not become infinity.
  EXPECT_TRUE(std::isnan(static_cast<float>(BFloat16(from_bits(0x7F800001)))));
  EXPECT_TRUE(std::isnan(static_cast<float>(BFloat16(from_bits(0xFF800001)))));
}

TEST(DType, BFloat16ToFloatIsExact) {
  EXPECT_EQ(bf16_value(0x3F80), 1.0f);
  EXPECT_EQ(bf16_value(0xC020), -2.5f);
  EXPECT_EQ(to_bits(bf16_value(0x4049)), 0x40490000u);
  // Every bf16 converts to float and back unchanged.
  for (uint32_t b = 0; b < 0x10000; b += 7) {
    if ((b & 0x7F80) == 0x7F80 && (b & 0x7F)) continue;  // NaNs
    EXPECT_EQ(bf16_bits(bf16_value(static_cast<uint16_t>(b))), b) << std::hex << b;
  }
}

TEST(DType, Float16KnownBitPatterns) {
  EXPECT_EQ(fp16_bits(1.0f), 0x3C00);
  EXPECT_EQ(fp16_bits(-2.0f), 0xC000);
  EXPECT_EQ(fp16_bits(0.5f), 0x3800);
  EXPECT_EQ(fp16_bits(0.0f), 0x0000);
  EXPECT_EQ(fp16_bits(-0.0f), 0x8000);
  EXPECT_EQ(fp16_bits(65504.0f), 0x7BFF);  // largest half
  EXPECT_EQ(fp16_bits(1.0f / 3.0f), 0x3555);
  EXPECT_EQ(fp16_bits(0.1f), 0x2E66);
  EXPECT_EQ(fp16_bits(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(fp16_bits(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(fp16_bits(std::numeric_limits<float>::infinity()), 0x7C00);
  EXPECT_EQ(fp16_bits(-std::numeric_limits<float>::infinity()), 0xFC00);
  EXPECT_EQ(fp16_bits(1e6f), 0x7C00);  // overflow
}

TEST(DType, Float16RoundsToNearestEven) {
  // 1 + 2^-11 is halfway between 0x3C00 and 0x3C01: to the even 0x3C00.
  EXPECT_EQ(fp16_bits(1.0f + std::ldexp(1.0f, -11)), 0x3C00);
  // 1 + 3 * 2^-11 is halfway between 0x3C01 and 0x3C02: to 0x3C02.
  EXPECT_EQ(fp16_bits(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);
  EXPECT_EQ(fp16_bits(std::nextafter(1.0f + std::ldexp(1.0f, -11), 2.0f)), 0x3C01);
  // 65520 is halfway between 65504 and 2^16 (not representable): to infinity.
  EXPECT_EQ(fp16_bits(65520.0f), 0x7C00);
  EXPECT_EQ(fp16_bits(65519.0f), 0x7BFF);
  // Subnormal ties: 2^-25 is halfway between 0 and 2^-24; 3 * 2^-25 between 1 and 2 ulps.
  EXPECT_EQ(fp16_bits(std::ldexp(1.0f, -25)), 0x0000);
  EXPECT_EQ(fp16_bits(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  EXPECT_EQ(fp16_bits(3 * std::ldexp(1.0f, -25)), 0x0002);
  EXPECT_EQ(fp16_bits(std::ldexp(1.0f, -26)), 0x0000);
  // A subnormal that rounds up into the smallest normal.
  EXPECT_EQ(fp16_bits(std::ldexp(1.0f, -14) * (1.0f - std::ldexp(1.0f, -12))), 0x0400);
}

TEST(DType, Float16ToFloat) {
  EXPECT_EQ(fp16_value(0x3C00), 1.0f);
  EXPECT_EQ(fp16_value(0x3555), 0.333251953125f);
  EXPECT_EQ(fp16_value(0x7BFF), 65504.0f);
  EXPECT_EQ(fp16_value(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(fp16_value(0x03FF), std::ldexp(1023.0f, -24));
  EXPECT_EQ(fp16_value(0x8000), -0.0f);
  EXPECT_TRUE(std::signbit(fp16_value(0x8000)));
  EXPECT_TRUE(std::isinf(fp16_value(0x7C00)));
  EXPECT_TRUE(std::isnan(fp16_value(0x7E00)));
  EXPECT_TRUE(std::isnan(static_cast<float>(Float16(std::numeric_limits<float>::quiet_NaN()))));
  // Every non-NaN half converts to float and back unchanged.
  for (uint32_t b = 0; b < 0x10000; ++b) {
    if ((b & 0x7C00) == 0x7C00 && (b & 0x3FF)) continue;
    ASSERT_EQ(fp16_bits(fp16_value(static_cast<uint16_t>(b))), b) << std::hex << b;
  }
}

TEST(DType, TensorConversionsRoundLikeTheScalarTypes) {
  std::vector<float> v = {1.0f, from_bits(0x3F808000), from_bits(0x3F818000), -2.5f, 0.1f, 65520.0f, 1e-8f};
  Tensor t = from_vector(v, {static_cast<int64_t>(v.size())});
  std::vector<float> bf = t.to(kBFloat16).to_vector<float>();
  std::vector<float> hf = t.to(kFloat16).to_vector<float>();
  for (size_t i = 0; i < v.size(); ++i) {
    EXPECT_EQ(to_bits(bf[i]), to_bits(static_cast<float>(BFloat16(v[i])))) << i;
    EXPECT_EQ(to_bits(hf[i]), to_bits(static_cast<float>(Float16(v[i])))) << i;
  }
  EXPECT_EQ(t.to(kBFloat16).dtype(), kBFloat16);
  EXPECT_EQ(t.to(kBFloat16).element_size(), 2u);
}

TEST(DType, IntegerAndBoolConversions) {
  Tensor t = from_vector(std::vector<float>{-2.7f, -0.5f, 0.0f, 0.5f, 3.9f, 100.0f}, {6});
  // Float to integer truncates toward zero, as C++ and PyTorch do.
  EXPECT_EQ(t.to(kInt64).to_vector<int64_t>(), (std::vector<int64_t>{-2, 0, 0, 0, 3, 100}));
  EXPECT_EQ(t.to(kInt32).to_vector<int32_t>(), (std::vector<int32_t>{-2, 0, 0, 0, 3, 100}));
  // Anything non-zero is true.
  EXPECT_EQ(t.to(kBool).to_vector<uint8_t>(), (std::vector<uint8_t>{1, 1, 0, 1, 1, 1}));
  Tensor i = from_vector(std::vector<int64_t>{-3, 0, 7, 255}, {4});
  EXPECT_EQ(i.to(kFloat32).to_vector<float>(), (std::vector<float>{-3, 0, 7, 255}));
  EXPECT_EQ(i.to(kUInt8).to_vector<uint8_t>()[3], 255);
  EXPECT_EQ(i.to(kBool).to(kInt64).to_vector<int64_t>(), (std::vector<int64_t>{1, 0, 1, 1}));
  // Large int64 values survive a round trip through int64 storage untouched.
  Tensor big = from_vector(std::vector<int64_t>{int64_t{1} << 40, -(int64_t{1} << 40) + 3}, {2});
  EXPECT_EQ(big.to_vector<int64_t>(), (std::vector<int64_t>{int64_t{1} << 40, -(int64_t{1} << 40) + 3}));
}

TEST(DType, Float64KeepsDoublePrecision) {
  Tensor d = from_vector(std::vector<double>{0.1, 1.0 / 3.0, 1e30}, {3}, {kFloat64});
  std::vector<double> back = d.to_vector<double>();
  EXPECT_EQ(back[0], 0.1);
  EXPECT_EQ(back[1], 1.0 / 3.0);
  EXPECT_EQ(back[2], 1e30);
  // float64 -> float32 rounds once, to nearest.
  std::vector<float> f = d.to(kFloat32).to_vector<float>();
  EXPECT_EQ(f[0], 0.1f);
  EXPECT_EQ(f[1], 1.0f / 3.0f);
  EXPECT_EQ(f[2], 1e30f);
  EXPECT_EQ(d.to(kFloat32).to(kFloat64).to_vector<double>()[0], static_cast<double>(0.1f));
}

}  // namespace
}  // namespace chorus
