// Pooling kernels against references written here from the definitions, in
// double: windows are enumerated in padded coordinates (not the kernels'
// clipped ranges), adaptive windows use std::floor / std::ceil. Backward
// kernels are checked against the naive backward, against the adjoint
// identity <pool(x), dy> == <x, pool_backward(dy)> (avg pools are linear),
// and for max pooling against central finite differences.
#include "testing/random.h"
#include "chorus/cpu/pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
#include <vector>

namespace chorus::cpu {
namespace {

using chorus::testing::random_vector;

// Distinct values at least 0.01 apart in random order: no ties, and a finite
// difference step of 1e-4 never changes which element is the max.
std::vector<float> distinct_random_vector(size_t size, uint32_t seed) {
  std::vector<float> v(size);
  for (size_t i = 0; i < size; ++i) v[i] = -1.0f + 0.01f * static_cast<float>(i);
  std::shuffle(v.begin(), v.end(), std::mt19937(seed));
  return v;
}

void expect_close(const std::vector<float>& got, const std::vector<double>& want, double rtol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], rtol * std::max(1.0, std::abs(want[i]))) << "at index " << i;
  }
}

double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += double(a[i]) * b[i];
  return s;
}

struct Window {
  int64_t n, c, h, w, kh, kw, sh, sw, ph, pw;
  int64_t oh() const { return (h + 2 * ph - kh) / sh + 1; }
  int64_t ow() const { return (w + 2 * pw - kw) / sw + 1; }
  int64_t in_size() const { return n * c * h * w; }
  int64_t out_size() const { return n * c * oh() * ow(); }
};

// Calls f(out_index, in_index) for every real (non-padding) input element
// of every output window, scanning each window row-major.
template <typename F>
void for_each_window_element(const Window& p, F&& f) {
  for (int64_t pl = 0; pl < p.n * p.c; ++pl)
    for (int64_t oy = 0; oy < p.oh(); ++oy)
      for (int64_t ox = 0; ox < p.ow(); ++ox)
        for (int64_t ky = 0; ky < p.kh; ++ky)
          for (int64_t kx = 0; kx < p.kw; ++kx) {
            const int64_t iy = oy * p.sh - p.ph + ky, ix = ox * p.sw - p.pw + kx;
            if (iy < 0 || iy >= p.h || ix < 0 || ix >= p.w) continue;
            f((pl * p.oh() + oy) * p.ow() + ox, (pl * p.h + iy) * p.w + ix);
          }
}

// Max pooling in double: values and flat in-plane argmax indices.
void ref_max_pool(const Window& p, const std::vector<float>& x, std::vector<double>* y,
                  std::vector<int64_t>* idx) {
  y->assign(p.out_size(), -std::numeric_limits<double>::infinity());
  idx->assign(p.out_size(), -1);
  for_each_window_element(p, [&](int64_t o, int64_t i) {
    if (x[i] > (*y)[o]) {
      (*y)[o] = x[i];
      (*idx)[o] = i % (p.h * p.w);
    }
  });
}

std::vector<double> ref_avg_pool(const Window& p, const std::vector<float>& x) {
  std::vector<double> y(p.out_size(), 0.0);
  for_each_window_element(p, [&](int64_t o, int64_t i) { y[o] += x[i]; });
  for (double& v : y) v /= double(p.kh * p.kw);  // count_include_pad=true
  return y;
}

std::vector<double> ref_avg_pool_backward(const Window& p, const std::vector<float>& dy) {
  std::vector<double> dx(p.in_size(), 0.0);
  for_each_window_element(p, [&](int64_t o, int64_t i) { dx[i] += dy[o] / double(p.kh * p.kw); });
  return dx;
}

const Window kWindows[] = {
    {2, 3, 7, 9, 3, 3, 2, 2, 1, 1},  // odd sizes, stride 2, padding
    {2, 2, 8, 6, 2, 2, 2, 2, 0, 0},  // the common 2x2/2
    {1, 3, 6, 7, 3, 2, 1, 2, 1, 1},  // non-square kernel and stride
    {2, 2, 9, 8, 2, 3, 3, 3, 1, 0},  // stride larger than the kernel
    {1, 1, 5, 5, 5, 5, 1, 1, 2, 2},  // kernel = input, maximal padding
    {2, 3, 10, 18, 2, 2, 2, 2, 0, 0},  // 2x2/2, rows of 9 outputs: four at a time, then one
    {1, 2, 6, 17, 2, 2, 2, 2, 0, 0},   // odd width: the last input column is in no window
};

TEST(PoolCpu, MaxPoolForwardMatchesReferenceValuesAndIndices) {
  uint32_t seed = 1;
  for (const Window& p : kWindows) {
    SCOPED_TRACE(seed);
    const auto x = random_vector(p.in_size(), seed++);
    std::vector<float> y(p.out_size(), std::nanf(""));
    std::vector<int64_t> idx(p.out_size(), -7);
    max_pool2d_forward(x.data(), p.n, p.c, p.h, p.w, p.kh, p.kw, p.sh, p.sw, p.ph, p.pw, y.data(),
                       idx.data());
    std::vector<double> y_ref;
    std::vector<int64_t> idx_ref;
    ref_max_pool(p, x, &y_ref, &idx_ref);
    expect_close(y, y_ref, 0.0);
    EXPECT_EQ(idx, idx_ref);
  }
}

TEST(PoolCpu, MaxPoolPaddingNeverWinsOnNegativeInput) {
  const Window p{1, 2, 4, 5, 3, 3, 1, 1, 1, 1};
  auto x = random_vector(p.in_size(), 11);
  for (float& v : x) v = -2.0f - std::abs(v);
  std::vector<float> y(p.out_size());
  std::vector<int64_t> idx(p.out_size());
  max_pool2d_forward(x.data(), p.n, p.c, p.h, p.w, p.kh, p.kw, p.sh, p.sw, p.ph, p.pw, y.data(),
                     idx.data());
  for (float v : y) EXPECT_LE(v, -2.0f);
}

TEST(PoolCpu, MaxPoolPropagatesNaN) {
  auto x = random_vector(16, 12);
  x[5] = std::nanf("");  // row 1, column 1 of a 4x4 plane
  std::vector<float> y(4);
  std::vector<int64_t> idx(4);
  max_pool2d_forward(x.data(), 1, 1, 4, 4, 2, 2, 2, 2, 0, 0, y.data(), idx.data());
  EXPECT_TRUE(std::isnan(y[0]));
  EXPECT_EQ(idx[0], 5);
  EXPECT_FALSE(std::isnan(y[1]));
}

// The 2x2 stride-2 windows four at a time (SSE on x86): ties keep the first
// position, a NaN anywhere in the window wins, two NaNs keep the later one,
// as the scalar rule and the reference do.
TEST(PoolCpu, MaxPool2x2FourAtATimeTiesAndNaNs) {
  const Window p{1, 2, 4, 20, 2, 2, 2, 2, 0, 0};
  auto x = random_vector(p.in_size(), 31);
  for (int64_t i = 0; i < 20; ++i) x[i] = x[20 + i] = 0.5f;  // plane 0, rows 0-1: every window a tie
  const float nan = std::nanf("");
  x[80 + 3] = nan;                       // plane 1, row 0: window 1's b
  x[80 + 20 + 8] = nan;                  // row 1: window 4's c
  x[80 + 20 + 13] = nan;                 // row 1: window 6's d
  x[80 + 10] = nan;                      // window 5: a and d both NaN
  x[80 + 20 + 11] = nan;
  std::vector<float> y(p.out_size());
  std::vector<int64_t> idx(p.out_size());
  max_pool2d_forward(x.data(), p.n, p.c, p.h, p.w, p.kh, p.kw, p.sh, p.sw, p.ph, p.pw, y.data(), idx.data());
  std::vector<double> y_ref;
  std::vector<int64_t> idx_ref;
  ref_max_pool(p, x, &y_ref, &idx_ref);
  for (int64_t i = 0; i < 10; ++i) EXPECT_EQ(idx[i], 2 * i) << "tie at window " << i;
  EXPECT_EQ(idx[20 + 1], 3);
  EXPECT_EQ(idx[20 + 4], 28);
  EXPECT_EQ(idx[20 + 6], 33);
  EXPECT_EQ(idx[20 + 5], 31);
  for (int64_t i : {21, 24, 25, 26}) EXPECT_TRUE(std::isnan(y[i])) << i;
  for (int64_t i = 0; i < p.out_size(); ++i) {
    if (i == 21 || (i >= 24 && i <= 26)) continue;  // the reference knows no NaN
    EXPECT_EQ(y[i], y_ref[i]) << i;
    EXPECT_EQ(idx[i], idx_ref[i]) << i;
  }
}

TEST(PoolCpu, MaxPoolBackwardMatchesFiniteDifferences) {
  uint32_t seed = 20;
  for (const Window& p : kWindows) {
    SCOPED_TRACE(seed);
    const auto x = distinct_random_vector(p.in_size(), seed++);
    const auto dy = random_vector(p.out_size(), seed++);
    std::vector<float> y(p.out_size());
    std::vector<int64_t> idx(p.out_size());
    max_pool2d_forward(x.data(), p.n, p.c, p.h, p.w, p.kh, p.kw, p.sh, p.sw, p.ph, p.pw, y.data(),
                       idx.data());
    std::vector<float> dx(p.in_size(), std::nanf(""));
    max_pool2d_backward(dy.data(), idx.data(), p.n, p.c, p.h, p.w, p.oh(), p.ow(), dx.data());

    // d/dx_i of L(x) = <maxpool(x), dy>, by central differences in double.
    std::vector<double> fd(p.in_size());
    const double step = 1e-4;
    for (int64_t i = 0; i < p.in_size(); ++i) {
      std::vector<float> xp = x, xm = x;
      xp[i] += static_cast<float>(step);
      xm[i] -= static_cast<float>(step);
      std::vector<double> yp, ym;
      std::vector<int64_t> unused;
      ref_max_pool(p, xp, &yp, &unused);
      ref_max_pool(p, xm, &ym, &unused);
      double lp = 0.0, lm = 0.0;
      for (int64_t o = 0; o < p.out_size(); ++o) {
        lp += yp[o] * dy[o];
        lm += ym[o] * dy[o];
      }
      fd[i] = (lp - lm) / (double(xp[i]) - double(xm[i]));
    }
    expect_close(dx, fd, 1e-4);
  }
}

TEST(PoolCpu, MaxPoolBackwardRejectsBadIndex) {
  std::vector<float> dy(4, 1.0f), dx(16);
  std::vector<int64_t> idx = {0, 3, 16, 5};
  EXPECT_THROW(max_pool2d_backward(dy.data(), idx.data(), 1, 1, 4, 4, 2, 2, dx.data()),
               std::invalid_argument);
}

TEST(PoolCpu, AvgPoolForwardBackwardCountIncludePad) {
  uint32_t seed = 40;
  for (const Window& p : kWindows) {
    SCOPED_TRACE(seed);
    const auto x = random_vector(p.in_size(), seed++);
    const auto dy = random_vector(p.out_size(), seed++);
    std::vector<float> y(p.out_size(), std::nanf("")), dx(p.in_size(), std::nanf(""));
    avg_pool2d_forward(x.data(), p.n, p.c, p.h, p.w, p.kh, p.kw, p.sh, p.sw, p.ph, p.pw, y.data());
    avg_pool2d_backward(dy.data(), p.n, p.c, p.h, p.w, p.kh, p.kw, p.sh, p.sw, p.ph, p.pw,
                        dx.data());
    expect_close(y, ref_avg_pool(p, x), 1e-5);
    expect_close(dx, ref_avg_pool_backward(p, dy), 1e-5);
    EXPECT_NEAR(dot(y, dy), dot(x, dx), 1e-5 * p.in_size());
  }
}

// Adaptive pooling, reference with PyTorch's rule spelled in floating point.
std::vector<double> ref_adaptive(int64_t planes, int64_t h, int64_t w, int64_t oh, int64_t ow,
                                 const std::vector<float>& x) {
  std::vector<double> y(planes * oh * ow);
  for (int64_t pl = 0; pl < planes; ++pl)
    for (int64_t i = 0; i < oh; ++i)
      for (int64_t j = 0; j < ow; ++j) {
        const auto y0 = int64_t(std::floor(double(i) * h / oh));
        const auto y1 = int64_t(std::ceil(double(i + 1) * h / oh));
        const auto x0 = int64_t(std::floor(double(j) * w / ow));
        const auto x1 = int64_t(std::ceil(double(j + 1) * w / ow));
        double s = 0.0;
        for (int64_t a = y0; a < y1; ++a)
          for (int64_t b = x0; b < x1; ++b) s += x[(pl * h + a) * w + b];
        y[(pl * oh + i) * ow + j] = s / double((y1 - y0) * (x1 - x0));
      }
  return y;
}

TEST(PoolCpu, AdaptiveAvgPoolForwardBackward) {
  struct Case {
    int64_t n, c, h, w, oh, ow;
  };
  const Case cases[] = {
      {2, 3, 7, 9, 3, 4},   // uneven, overlapping windows
      {2, 4, 5, 5, 1, 1},   // global average pooling
      {1, 2, 4, 6, 6, 8},   // output larger than input
      {2, 1, 10, 3, 3, 3},  // non-square
      {1, 2, 8, 8, 4, 4},   // exact division: plain 2x2 average
  };
  uint32_t seed = 60;
  for (const Case& k : cases) {
    SCOPED_TRACE(seed);
    const int64_t in = k.n * k.c * k.h * k.w, out = k.n * k.c * k.oh * k.ow;
    const auto x = random_vector(in, seed++);
    const auto dy = random_vector(out, seed++);
    std::vector<float> y(out, std::nanf("")), dx(in, std::nanf(""));
    adaptive_avg_pool2d_forward(x.data(), k.n, k.c, k.h, k.w, k.oh, k.ow, y.data());
    adaptive_avg_pool2d_backward(dy.data(), k.n, k.c, k.h, k.w, k.oh, k.ow, dx.data());
    expect_close(y, ref_adaptive(k.n * k.c, k.h, k.w, k.oh, k.ow, x), 1e-5);
    // The backward of a linear map is its transpose: build it column by
    // column from the reference forward on unit vectors, per plane.
    std::vector<double> dx_ref(in, 0.0);
    const int64_t plane = k.h * k.w;
    for (int64_t e = 0; e < plane; ++e) {
      std::vector<float> unit(plane, 0.0f);
      unit[e] = 1.0f;
      const auto col = ref_adaptive(1, k.h, k.w, k.oh, k.ow, unit);
      for (int64_t pl = 0; pl < k.n * k.c; ++pl)
        for (int64_t o = 0; o < k.oh * k.ow; ++o)
          dx_ref[pl * plane + e] += col[o] * dy[pl * k.oh * k.ow + o];
    }
    expect_close(dx, dx_ref, 1e-5);
    EXPECT_NEAR(dot(y, dy), dot(x, dx), 1e-5 * in);
  }
}

TEST(PoolCpu, LargeBatchSplitsOverThreadsConsistently) {
  // Enough planes for the CPU pool to split the work; the result must equal
  // the reference everywhere, including the last share.
  const Window p{16, 33, 16, 16, 3, 3, 2, 2, 1, 1};
  const auto x = random_vector(p.in_size(), 80);
  std::vector<float> y(p.out_size());
  std::vector<int64_t> idx(p.out_size());
  max_pool2d_forward(x.data(), p.n, p.c, p.h, p.w, p.kh, p.kw, p.sh, p.sw, p.ph, p.pw, y.data(),
                     idx.data());
  std::vector<double> y_ref;
  std::vector<int64_t> idx_ref;
  ref_max_pool(p, x, &y_ref, &idx_ref);
  expect_close(y, y_ref, 0.0);
  EXPECT_EQ(idx, idx_ref);
  avg_pool2d_forward(x.data(), p.n, p.c, p.h, p.w, p.kh, p.kw, p.sh, p.sw, p.ph, p.pw, y.data());
  expect_close(y, ref_avg_pool(p, x), 1e-5);
}

TEST(PoolCpu, RejectsBadParameters) {
  std::vector<float> buf(256, 0.5f);
  std::vector<int64_t> idx(256);
  // Padding more than half the kernel (PyTorch rejects it too).
  EXPECT_THROW(max_pool2d_forward(buf.data(), 1, 1, 8, 8, 2, 2, 2, 2, 2, 2, buf.data(), idx.data()),
               std::invalid_argument);
  // Kernel larger than the input.
  EXPECT_THROW(avg_pool2d_forward(buf.data(), 1, 1, 2, 2, 3, 3, 1, 1, 0, 0, buf.data()),
               std::invalid_argument);
  EXPECT_THROW(avg_pool2d_forward(buf.data(), 1, 1, 4, 4, 2, 2, 0, 2, 0, 0, buf.data()),
               std::invalid_argument);
  EXPECT_THROW(adaptive_avg_pool2d_forward(buf.data(), 1, 1, 4, 4, 0, 2, buf.data()),
               std::invalid_argument);
  try {
    max_pool2d_forward(buf.data(), 1, 1, 8, 8, 3, 3, 1, 1, 2, 1, buf.data(), idx.data());
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("max_pool2d_forward"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("pad=2x1"), std::string::npos) << e.what();
  }
}

TEST(PoolCpu, OutSizeIsFloorMode) {
  EXPECT_EQ(pool_out_size(7, 3, 2, 1), 4);
  EXPECT_EQ(pool_out_size(8, 2, 2, 0), 4);
  EXPECT_EQ(pool_out_size(9, 2, 2, 0), 4);
  EXPECT_EQ(pool_out_size(5, 5, 1, 0), 1);
  EXPECT_THROW(pool_out_size(2, 3, 1, 0), std::invalid_argument);
}

}  // namespace
}  // namespace chorus::cpu
