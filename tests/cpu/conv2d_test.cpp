// conv2d kernels against a direct double-precision convolution written here
// from the definition (no im2col), on random inputs. backward_input is also
// checked as the adjoint of forward: <conv(x), dy> == <x, conv_bwd_input(dy)>.
#include "testing/random.h"
#include "chorus/cpu/conv2d.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>
#include <vector>

namespace chorus::cpu {
namespace {

using chorus::testing::random_vector;

void expect_close(const std::vector<float>& got, const std::vector<double>& want, double rtol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], rtol * std::max(1.0, std::abs(want[i]))) << "at index " << i;
  }
}

struct Sizes {
  int64_t oh, ow, x, w, y;
};
Sizes sizes(const Conv2dShape& s) {
  const int64_t oh = s.out_h(), ow = s.out_w();
  return {oh, ow, s.n * s.c_in * s.h * s.w, s.c_out * (s.c_in / s.groups) * s.kh * s.kw,
          s.n * s.c_out * oh * ow};
}

// Visits every (output element, weight tap, input element) triple that the
// convolution multiplies together; the three references below are this loop.
template <typename F>
void for_each_tap(const Conv2dShape& s, F&& f) {
  const Sizes z = sizes(s);
  const int64_t cin_g = s.c_in / s.groups, cout_g = s.c_out / s.groups;
  for (int64_t b = 0; b < s.n; ++b)
    for (int64_t co = 0; co < s.c_out; ++co)
      for (int64_t oy = 0; oy < z.oh; ++oy)
        for (int64_t ox = 0; ox < z.ow; ++ox) {
          const int64_t yi = ((b * s.c_out + co) * z.oh + oy) * z.ow + ox;
          const int64_t gr = co / cout_g;
          for (int64_t cl = 0; cl < cin_g; ++cl)
            for (int64_t ki = 0; ki < s.kh; ++ki)
              for (int64_t kj = 0; kj < s.kw; ++kj) {
                const int64_t iy = oy * s.stride_h - s.pad_h + ki * s.dil_h;
                const int64_t ix = ox * s.stride_w - s.pad_w + kj * s.dil_w;
                if (iy < 0 || iy >= s.h || ix < 0 || ix >= s.w) continue;
                const int64_t ci = gr * cin_g + cl;
                const int64_t xi = ((b * s.c_in + ci) * s.h + iy) * s.w + ix;
                const int64_t wi = ((co * cin_g + cl) * s.kh + ki) * s.kw + kj;
                f(yi, wi, xi);
              }
        }
}

std::vector<double> ref_forward(const Conv2dShape& s, const std::vector<float>& x,
                                const std::vector<float>& w, const std::vector<float>* bias) {
  const Sizes z = sizes(s);
  std::vector<double> y(z.y, 0.0);
  if (bias) {
    for (int64_t i = 0; i < z.y; ++i) y[i] = (*bias)[(i / (z.oh * z.ow)) % s.c_out];
  }
  for_each_tap(s, [&](int64_t yi, int64_t wi, int64_t xi) { y[yi] += double(w[wi]) * x[xi]; });
  return y;
}

std::vector<double> ref_backward_input(const Conv2dShape& s, const std::vector<float>& dy,
                                       const std::vector<float>& w) {
  std::vector<double> dx(sizes(s).x, 0.0);
  for_each_tap(s, [&](int64_t yi, int64_t wi, int64_t xi) { dx[xi] += double(w[wi]) * dy[yi]; });
  return dx;
}

std::vector<double> ref_backward_weight(const Conv2dShape& s, const std::vector<float>& dy,
                                        const std::vector<float>& x) {
  std::vector<double> dw(sizes(s).w, 0.0);
  for_each_tap(s, [&](int64_t yi, int64_t wi, int64_t xi) { dw[wi] += double(x[xi]) * dy[yi]; });
  return dw;
}

// Runs all three kernels on random data and compares them with the references.
void check_all(const Conv2dShape& s, uint32_t seed) {
  SCOPED_TRACE(::testing::Message()
               << "n=" << s.n << " c_in=" << s.c_in << " h=" << s.h << " w=" << s.w
               << " c_out=" << s.c_out << " k=" << s.kh << "x" << s.kw << " stride=" << s.stride_h
               << "x" << s.stride_w << " pad=" << s.pad_h << "x" << s.pad_w << " dil=" << s.dil_h
               << "x" << s.dil_w << " groups=" << s.groups);
  const Sizes z = sizes(s);
  const auto x = random_vector(z.x, seed);
  const auto w = random_vector(z.w, seed + 1);
  const auto bias = random_vector(s.c_out, seed + 2);
  const auto dy = random_vector(z.y, seed + 3);

  // Outputs start as NaN so that a kernel that skips an element is caught.
  const float nan = std::nanf("");
  std::vector<float> y(z.y, nan), y_nobias(z.y, nan);
  conv2d_forward(s, x.data(), w.data(), bias.data(), y.data());
  conv2d_forward(s, x.data(), w.data(), nullptr, y_nobias.data());
  expect_close(y, ref_forward(s, x, w, &bias), 1e-4);
  expect_close(y_nobias, ref_forward(s, x, w, nullptr), 1e-4);

  std::vector<float> dx(z.x, nan);
  conv2d_backward_input(s, dy.data(), w.data(), dx.data());
  expect_close(dx, ref_backward_input(s, dy, w), 1e-4);

  // Adjoint identity, in double over the float results.
  double lhs = 0.0, rhs = 0.0, scale = 0.0;
  for (int64_t i = 0; i < z.y; ++i) lhs += double(y_nobias[i]) * dy[i];
  for (int64_t i = 0; i < z.x; ++i) rhs += double(x[i]) * dx[i];
  for (int64_t i = 0; i < z.x; ++i) scale += std::abs(double(x[i]) * dx[i]);
  EXPECT_NEAR(lhs, rhs, 1e-5 * std::max(1.0, scale));

  std::vector<float> dw(z.w, nan), db(s.c_out, nan);
  conv2d_backward_weight(s, dy.data(), x.data(), dw.data(), db.data());
  expect_close(dw, ref_backward_weight(s, dy, x), 1e-4);
  std::vector<double> db_ref(s.c_out, 0.0);
  for (int64_t i = 0; i < z.y; ++i) db_ref[(i / (z.oh * z.ow)) % s.c_out] += dy[i];
  expect_close(db, db_ref, 1e-4);

  // dbias is optional.
  std::vector<float> dw2(z.w, nan);
  conv2d_backward_weight(s, dy.data(), x.data(), dw2.data(), nullptr);
  EXPECT_EQ(dw, dw2);
}

TEST(Conv2dCpu, ForwardBackwardBasic3x3Pad1) {
  check_all(
      {.n = 2, .c_in = 3, .h = 7, .w = 9, .c_out = 4, .kh = 3, .kw = 3, .pad_h = 1, .pad_w = 1}, 1);
}

TEST(Conv2dCpu, ForwardBackwardNoPaddingOddSizes) {
  check_all({.n = 3, .c_in = 2, .h = 11, .w = 6, .c_out = 5, .kh = 3, .kw = 2}, 2);
}

TEST(Conv2dCpu, ForwardBackwardStride2NonSquareKernel) {
  check_all({.n = 2,
             .c_in = 3,
             .h = 10,
             .w = 9,
             .c_out = 4,
             .kh = 5,
             .kw = 3,
             .stride_h = 2,
             .stride_w = 2,
             .pad_h = 2,
             .pad_w = 1},
            3);
  check_all({.n = 2,
             .c_in = 2,
             .h = 8,
             .w = 13,
             .c_out = 3,
             .kh = 3,
             .kw = 3,
             .stride_h = 1,
             .stride_w = 3,
             .pad_h = 0,
             .pad_w = 2},
            4);
}

TEST(Conv2dCpu, ForwardGroupsDilation) {
  check_all({.n = 2,
             .c_in = 4,
             .h = 9,
             .w = 10,
             .c_out = 6,
             .kh = 3,
             .kw = 3,
             .pad_h = 2,
             .pad_w = 2,
             .dil_h = 2,
             .dil_w = 2,
             .groups = 2},
            5);
  check_all({.n = 2,
             .c_in = 6,
             .h = 12,
             .w = 7,
             .c_out = 3,
             .kh = 3,
             .kw = 2,
             .stride_h = 2,
             .stride_w = 1,
             .pad_h = 1,
             .pad_w = 3,
             .dil_h = 3,
             .dil_w = 2,
             .groups = 3},
            6);
}

TEST(Conv2dCpu, Depthwise) {
  check_all({.n = 2,
             .c_in = 5,
             .h = 8,
             .w = 8,
             .c_out = 10,
             .kh = 3,
             .kw = 3,
             .stride_h = 2,
             .stride_w = 2,
             .pad_h = 1,
             .pad_w = 1,
             .groups = 5},
            7);
}

TEST(Conv2dCpu, PointwiseFastPath) {
  check_all({.n = 3, .c_in = 6, .h = 5, .w = 7, .c_out = 4}, 8);
  check_all({.n = 2, .c_in = 6, .h = 5, .w = 7, .c_out = 4, .groups = 2}, 9);
}

TEST(Conv2dCpu, PointwiseStrideAndPaddingUseIm2col) {
  check_all({.n = 2, .c_in = 3, .h = 7, .w = 6, .c_out = 4, .stride_h = 2, .stride_w = 2}, 10);
  check_all({.n = 2, .c_in = 3, .h = 4, .w = 5, .c_out = 2, .pad_h = 1, .pad_w = 2}, 11);
}

TEST(Conv2dCpu, ManyImagesSpanSeveralChunks) {
  // 5x5 outputs put many images in one im2col chunk; 150 leaves a partial one.
  check_all(
      {.n = 150, .c_in = 3, .h = 5, .w = 5, .c_out = 4, .kh = 3, .kw = 3, .pad_h = 1, .pad_w = 1},
      12);
}

TEST(Conv2dCpu, ManyImagesWithGroupsStrideDilation) {
  // Several chunks run in parallel, each with grouped GEMMs; 37 images do
  // not divide evenly into chunks.
  check_all({.n = 37,
             .c_in = 4,
             .h = 9,
             .w = 8,
             .c_out = 6,
             .kh = 3,
             .kw = 3,
             .stride_h = 2,
             .stride_w = 1,
             .pad_h = 2,
             .pad_w = 1,
             .dil_h = 2,
             .dil_w = 1,
             .groups = 2},
            14);
}

TEST(Conv2dCpu, KernelCoversWholePaddedInput) {
  check_all(
      {.n = 2, .c_in = 2, .h = 3, .w = 2, .c_out = 3, .kh = 5, .kw = 4, .pad_h = 1, .pad_w = 1},
      13);
}

TEST(Conv2dCpu, EmptyBatchZeroesWeightGradient) {
  const Conv2dShape s{.n = 0, .c_in = 2, .h = 4, .w = 4, .c_out = 3, .kh = 3, .kw = 3};
  std::vector<float> dw(3 * 2 * 9, 1.0f), db(3, 1.0f);
  conv2d_backward_weight(s, nullptr, nullptr, dw.data(), db.data());
  for (float v : dw) EXPECT_EQ(v, 0.0f);
  for (float v : db) EXPECT_EQ(v, 0.0f);
}

TEST(Conv2dCpu, RejectsBadShapes) {
  std::vector<float> buf(1024, 0.5f);
  auto fwd = [&](Conv2dShape s) { conv2d_forward(s, buf.data(), buf.data(), nullptr, buf.data()); };
  EXPECT_THROW(fwd({.n = 1, .c_in = 3, .h = 4, .w = 4, .c_out = 4, .groups = 2}),
               std::invalid_argument);
  EXPECT_THROW(
      fwd({.n = 1, .c_in = 2, .h = 4, .w = 4, .c_out = 2, .kh = 3, .kw = 3, .stride_h = 0}),
      std::invalid_argument);
  EXPECT_THROW(fwd({.n = 1, .c_in = 2, .h = 2, .w = 4, .c_out = 2, .kh = 3, .kw = 3}),
               std::invalid_argument);
  try {
    fwd({.n = 1, .c_in = 2, .h = 4, .w = 4, .c_out = 2, .pad_h = -1});
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("conv2d_forward"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("pad=-1x0"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace chorus::cpu
