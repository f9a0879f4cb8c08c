// CPU random kernels: exact agreement with the Philox formulas of Note
// [Random formulas] (cuda/kernels/random.cu; both devices compute them), moments
// within five standard errors over 1e5 draws, and determinism: the same
// RngState gives the same numbers whatever the tensor size (so thread count).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <vector>

#include "chorus/core/error.h"
#include "chorus/core/philox.h"
#include "chorus/cpu/kernels.h"

namespace chorus::cpu {
namespace {

constexpr int64_t kDraws = 100000;  // > the parallel grain, so threads are used

Tensor empty(const Shape& s, DType dt) {
  return detail::empty_tensor(s, dt, Device(DeviceType::CPU, 0));
}

std::vector<double> values_of(const Tensor& t) {
  std::vector<double> v(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) {
    switch (t.dtype()) {
      case kFloat32: v[i] = t.data<float>()[i]; break;
      case kBFloat16: v[i] = static_cast<float>(t.data<BFloat16>()[i]); break;
      case kFloat16: v[i] = static_cast<float>(t.data<Float16>()[i]); break;
      case kInt64: v[i] = static_cast<double>(t.data<int64_t>()[i]); break;
      case kInt32: v[i] = t.data<int32_t>()[i]; break;
      case kUInt8: v[i] = t.data<uint8_t>()[i]; break;
      default: ADD_FAILURE() << "unexpected dtype " << t.dtype();
    }
  }
  return v;
}

struct Moments {
  double mean, var;
};
Moments moments(const std::vector<double>& v) {
  double s = 0, s2 = 0;
  for (double x : v) s += x;
  const double mean = s / v.size();
  for (double x : v) s2 += (x - mean) * (x - mean);
  return {mean, s2 / (v.size() - 1)};
}

TEST(RandomCpu, UniformMatchesPhiloxFormulaExactly) {
  const RngState rng{1234, 77};
  Tensor out = empty({kDraws}, kFloat32);
  uniform(out, -2.0, 3.0, rng);
  const float* p = out.data<float>();
  for (int64_t i = 0; i < kDraws; i += 997) {
    volatile float scaled = 5.0f * philox::uniform(rng.seed, rng.offset, i);  // no fma
    const float want = -2.0f + scaled;
    ASSERT_EQ(p[i], want) << "at " << i;
  }
}

TEST(RandomCpu, UniformMomentsWithinStatisticalBounds) {
  const double lo = -2, hi = 3;
  for (DType dt : {kFloat32, kBFloat16, kFloat16}) {
    Tensor out = empty({kDraws}, dt);
    uniform(out, lo, hi, RngState{42, 0});
    const std::vector<double> v = values_of(out);
    for (double x : v) ASSERT_TRUE(x >= lo && x <= hi) << x << " for " << dt;
    const Moments m = moments(v);
    const double var = (hi - lo) * (hi - lo) / 12;
    // Standard errors: sqrt(var/n) for the mean, var*sqrt(0.8/n) for the
    // variance (uniform kurtosis 1.8). Rounding to bf16 adds ~1e-3 of bias.
    EXPECT_NEAR(m.mean, (lo + hi) / 2, 5 * std::sqrt(var / kDraws) + 2e-3) << dt;
    EXPECT_NEAR(m.var, var, 5 * var * std::sqrt(0.8 / kDraws) + 2e-3) << dt;
  }
}

TEST(RandomCpu, SameStateGivesSameNumbersAndOffsetsDiffer) {
  Tensor a = empty({kDraws}, kFloat32), b = empty({kDraws}, kFloat32);
  Tensor c = empty({kDraws}, kFloat32);
  uniform(a, 0, 1, RngState{9, 100});
  uniform(b, 0, 1, RngState{9, 100});
  uniform(c, 0, 1, RngState{9, 101});
  EXPECT_EQ(std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()), 0);
  int64_t equal = 0;
  for (int64_t i = 0; i < kDraws; ++i) equal += a.data<float>()[i] == c.data<float>()[i];
  EXPECT_LT(equal, 100);  // coincidences only (24-bit values)
}

TEST(RandomCpu, SmallAndLargeFillsAgreeOnTheirCommonPrefix) {
  // The small fill runs inline, the large one on the thread pool: counter-based
  // numbers must not notice.
  Tensor small = empty({1000}, kFloat32), large = empty({kDraws}, kFloat32);
  normal(small, 0, 1, RngState{5, 3});
  normal(large, 0, 1, RngState{5, 3});
  EXPECT_EQ(std::memcmp(small.raw_data(), large.raw_data(), small.nbytes()), 0);
}

TEST(RandomCpu, NormalMatchesBoxMullerFormulaExactly) {
  // Note [Random formulas] (cuda/kernels/random.cu): Box-Muller in double on words 2i
  // and 2i+1, multiply and add rounded separately, then rounded to float.
  const RngState rng{77, 5};
  Tensor out = empty({4096}, kFloat32);
  normal(out, 1.5, 2.0, rng);
  for (int64_t i = 0; i < out.numel(); i += 37) {
    const uint64_t u = static_cast<uint64_t>(i);
    const double u1 = philox::uniform(rng.seed, rng.offset, 2 * u);
    const double u2 = philox::uniform(rng.seed, rng.offset, 2 * u + 1);
    const double z = std::sqrt(-2.0 * std::log(1.0 - u1)) * std::cos(2.0 * M_PI * u2);
    volatile double scaled = 2.0 * z;
    ASSERT_EQ(out.data<float>()[i], static_cast<float>(1.5 + scaled)) << "at " << i;
  }
}

TEST(RandomCpu, NormalMomentsWithinStatisticalBounds) {
  Tensor out = empty({kDraws}, kFloat32);
  normal(out, 0.0, 1.0, RngState{2024, 0});
  const std::vector<double> v = values_of(out);
  const Moments m = moments(v);
  EXPECT_NEAR(m.mean, 0.0, 5 / std::sqrt(double(kDraws)));
  EXPECT_NEAR(std::sqrt(m.var), 1.0, 5 * std::sqrt(0.5 / kDraws));
  // Tails: P(|z| > 2) = 0.0455 for a true normal.
  int64_t tail = 0;
  for (double x : v) tail += std::abs(x) > 2;
  const double p = 0.0455;
  EXPECT_NEAR(double(tail) / kDraws, p, 5 * std::sqrt(p * (1 - p) / kDraws));

  Tensor shifted = empty({kDraws}, kBFloat16);
  normal(shifted, 3.0, 2.0, RngState{2024, 1});
  const Moments ms = moments(values_of(shifted));
  EXPECT_NEAR(ms.mean, 3.0, 5 * 2 / std::sqrt(double(kDraws)) + 1e-2);
  EXPECT_NEAR(std::sqrt(ms.var), 2.0, 5 * 2 * std::sqrt(0.5 / kDraws) + 1e-2);
}

TEST(RandomCpu, RandintCoversRangeUniformly) {
  const int64_t lo = -3, hi = 7;  // 10 values
  for (DType dt : {kInt64, kInt32, kFloat32}) {
    Tensor out = empty({kDraws}, dt);
    randint(out, lo, hi, RngState{11, 0});
    std::map<int64_t, int64_t> count;
    for (double x : values_of(out)) {
      ASSERT_EQ(x, std::floor(x));
      ASSERT_TRUE(x >= lo && x < hi) << x;
      ++count[static_cast<int64_t>(x)];
    }
    ASSERT_EQ(count.size(), 10u) << dt;
    const double p = 0.1, sd = std::sqrt(p * (1 - p) / kDraws);
    for (auto [value, n] : count) EXPECT_NEAR(double(n) / kDraws, p, 5 * sd) << value;
  }
  Tensor bytes = empty({1000}, kUInt8);
  randint(bytes, 0, 256, RngState{11, 0});
  for (int64_t i = 0; i < 1000; ++i) {
    ASSERT_EQ(bytes.data<uint8_t>()[i], philox::word(11, 0, i) % 256);
  }
}

TEST(RandomCpu, DropoutKeepsOneMinusPAndScales) {
  const double p = 0.3;
  for (DType dt : {kFloat32, kBFloat16}) {
    Tensor mask = empty({kDraws}, dt);
    dropout_mask(mask, p, RngState{8, 8});
    const double scale = dt == kFloat32 ? double(float(1 / (1 - p)))
                                        : double(float(BFloat16(float(1 / (1 - p)))));
    int64_t kept = 0;
    for (double x : values_of(mask)) {
      ASSERT_TRUE(x == 0 || x == scale) << x;
      kept += x != 0;
    }
    EXPECT_NEAR(double(kept) / kDraws, 1 - p, 5 * std::sqrt(p * (1 - p) / kDraws)) << dt;
  }
  Tensor all = empty({1000}, kFloat32);
  dropout_mask(all, 0.0, RngState{8, 8});
  for (double x : values_of(all)) ASSERT_EQ(x, 1.0);
}

TEST(RandomCpu, BadArgumentsThrow) {
  Tensor ints = empty({4}, kInt64), floats = empty({4}, kFloat32);
  EXPECT_THROW(uniform(ints, 0, 1, {}), ValueError);
  EXPECT_THROW(randint(floats, 5, 5, {}), ValueError);
  EXPECT_THROW(dropout_mask(floats, 1.5, {}), ValueError);
  EXPECT_THROW(normal(floats, 0, -1, {}), ValueError);
}

}  // namespace
}  // namespace chorus::cpu
