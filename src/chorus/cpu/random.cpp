// Random fills on the CPU: uniform, normal, randint and the dropout mask.
//
// Every element is a pure function of (seed, offset, element index) through
// Philox (core/philox.h), with the formulas of Note [Random formulas] in
// cuda/kernels/random.cu, so a tensor filled on cpu and on cuda:0 from the same
// RngState holds the same numbers. With U(k) = philox::uniform(seed, offset, k):
//   uniform  i: float(lo) + float(hi - lo) * U(i)            (float, no fma)
//   normal   i: u1 = U(2i), u2 = U(2i+1) as doubles,
//               z = sqrt(-2 log(1 - u1)) * cos(2 pi u2),  float(mean + std * z)
//   randint  i: lo + (int64)(word(i) % (uint64)(hi - lo))
//   dropout  i: U(i) >= float(p) ? float(1 / (1 - p)) : 0
// The normal works in double so that glibc's and CUDA's log/cos, both within
// an ulp or so of the truth in double, round to the same float. `1 - u1` lies
// in (0, 1], so the log never sees 0. The multiply and the add are kept
// apart (see no_fma) because CUDA rounds both: a fused multiply-add, which
// compilers emit under -march flags with FMA, would round once and differ.
// randint draws one 32-bit word per element, so a range wider than 2^32 only
// reaches its first 2^32 values.
//
// Because elements are independent, large tensors are split over the CPU
// thread pool (cpu/parallel.h); the result does not depend on how many
// threads there are. float64 outputs (a CPU-only dtype) hold the float value.
#include <cmath>
#include <cstdint>

#include "chorus/core/error.h"
#include "chorus/core/philox.h"
#include "chorus/cpu/dtype_dispatch.h"
#include "chorus/cpu/kernels.h"
#include "chorus/cpu/parallel.h"

namespace chorus::cpu {
namespace {

constexpr double kTwoPi = 6.283185307179586476925286766559;

// a + b * c with the product rounded on its own: the volatile store keeps the
// compiler from contracting the two into one fused multiply-add.
template <typename T>
T no_fma(T a, T b, T c) {
  volatile T product = b * c;
  return a + product;
}

// Below this many elements a thread costs more than it saves.
constexpr int64_t kGrain = 1 << 15;

// out[i] = value(i) converted to T, for every element. `value` returns float
// for the float fills, int64_t for randint.
template <typename T, typename V>
void fill_with(const Tensor& out, V&& value) {
  T* p = out.data<T>();
  parallel_for(out.numel(), kGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) p[i] = from_compute<T>(value(static_cast<uint64_t>(i)));
  });
}

template <typename V>
void fill_floating(const char* op, const Tensor& out, V&& value) {
  detail::check_defined(out, op, "out");
  CHORUS_CHECK(out.is_contiguous(), op, ": out must be contiguous, got ", out.describe());
  switch (out.dtype()) {
    case kFloat32: return fill_with<float>(out, value);
    case kBFloat16: return fill_with<BFloat16>(out, value);
    case kFloat16: return fill_with<Float16>(out, value);
    case kFloat64: return fill_with<double>(out, value);
    default:
      CHORUS_THROW(ValueError, op, ": out must be a floating dtype, got ", out.describe());
  }
}

}  // namespace

void uniform(const Tensor& out, double lo, double hi, RngState rng) {
  CHORUS_CHECK(lo <= hi, "uniform: need lo <= hi, got lo=", lo, " hi=", hi);
  const float lo_f = static_cast<float>(lo), range = static_cast<float>(hi - lo);
  fill_floating("uniform", out, [=](uint64_t i) {
    return no_fma(lo_f, range, philox::uniform(rng.seed, rng.offset, i));
  });
}

void normal(const Tensor& out, double mean, double std, RngState rng) {
  CHORUS_CHECK(std >= 0, "normal: std must be >= 0, got ", std);
  fill_floating("normal", out, [=](uint64_t i) {
    const double u1 = philox::uniform(rng.seed, rng.offset, 2 * i);
    const double u2 = philox::uniform(rng.seed, rng.offset, 2 * i + 1);
    const double z = std::sqrt(-2.0 * std::log(1.0 - u1)) * std::cos(kTwoPi * u2);
    return static_cast<float>(no_fma(mean, std, z));
  });
}

void randint(const Tensor& out, int64_t lo, int64_t hi, RngState rng) {
  detail::check_defined(out, "randint", "out");
  CHORUS_CHECK(lo < hi, "randint: need lo < hi, got lo=", lo, " hi=", hi);
  CHORUS_CHECK(out.is_contiguous(), "randint: out must be contiguous, got ", out.describe());
  const uint64_t range = static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo);
  auto value = [=](uint64_t i) {
    return lo + static_cast<int64_t>(philox::word(rng.seed, rng.offset, i) % range);
  };
  switch (out.dtype()) {
    case kInt64: return fill_with<int64_t>(out, value);
    case kInt32: return fill_with<int32_t>(out, value);
    case kUInt8: return fill_with<uint8_t>(out, value);
    case kFloat32: return fill_with<float>(out, value);
    case kBFloat16: return fill_with<BFloat16>(out, value);
    case kFloat16: return fill_with<Float16>(out, value);
    case kFloat64: return fill_with<double>(out, value);
    default:
      CHORUS_THROW(ValueError, "randint: out must be int64, int32, uint8 or a float dtype, got ",
                   out.describe());
  }
}

void dropout_mask(const Tensor& out, double p, RngState rng) {
  CHORUS_CHECK(p >= 0 && p <= 1, "dropout_mask: p must be in [0, 1], got ", p);
  // The threshold and scale are rounded to float once, as the CUDA kernel
  // does, so both devices keep exactly the same elements. With p == 1 no
  // uniform number reaches the threshold and the scale is never used.
  const float threshold = static_cast<float>(p);
  const float scale = p < 1 ? static_cast<float>(1.0 / (1.0 - p)) : 0.0f;
  fill_floating("dropout_mask", out, [=](uint64_t i) {
    return philox::uniform(rng.seed, rng.offset, i) >= threshold ? scale : 0.0f;
  });
}

}  // namespace chorus::cpu
