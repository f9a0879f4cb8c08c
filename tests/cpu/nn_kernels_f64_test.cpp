// The float64 kernels of cpu/nn_kernels_f64.h against the float32 kernels of
// conv2d.h, pool.h and batch_norm.h, on the same random inputs: two
// independent implementations of one contract (naive loops vs im2col + GEMM,
// parallel planes, float maps) must agree to float precision. Shapes cover
// groups, dilation, stride 2 and padding. Max pooling must also pick the same
// indices (inputs are distinct, so there are no ties).
#include "chorus/cpu/nn_kernels_f64.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <stdexcept>
#include <vector>

#include "chorus/cpu/batch_norm.h"
#include "chorus/cpu/conv2d.h"
#include "chorus/cpu/pool.h"
#include "testing/random.h"

namespace chorus::cpu {
namespace {

// The same random values in double and in float (the doubles are floats
// widened, so both kernels see identical inputs).
struct Values {
  std::vector<double> d;
  std::vector<float> f;
};
Values random_values(int64_t size, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  Values v;
  v.f = chorus::testing::random_vector(static_cast<size_t>(size), seed, lo, hi);
  v.d.assign(v.f.begin(), v.f.end());
  return v;
}

// Distinct values (a shuffled ramp), so that max pooling has no ties.
Values distinct_values(int64_t size, uint32_t seed) {
  std::vector<int> order(size);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(seed));
  Values v{std::vector<double>(size), std::vector<float>(size)};
  for (int64_t i = 0; i < size; ++i) v.d[i] = v.f[i] = static_cast<float>(order[i]) * 0.25f - 3.0f;
  return v;
}

void expect_close(const std::vector<double>& want, const std::vector<float>& got,
                  const char* what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  for (size_t i = 0; i < want.size(); ++i)
    ASSERT_NEAR(got[i], want[i], 1e-4 * std::max(1.0, std::abs(want[i])))
        << what << " at index " << i;
}

// ---- convolution -------------------------------------------------------------------

class Conv2dF64 : public ::testing::TestWithParam<Conv2dShape> {};

TEST_P(Conv2dF64, AgreesWithFloatKernels) {
  const Conv2dShape s = GetParam();
  check_conv2d_shape("test", s);
  const int64_t nx = s.n * s.c_in * s.h * s.w;
  const int64_t nw = s.c_out * (s.c_in / s.groups) * s.kh * s.kw;
  const int64_t ny = s.n * s.c_out * s.out_h() * s.out_w();
  const Values x = random_values(nx, 1), w = random_values(nw, 2), b = random_values(s.c_out, 3);
  const Values dy = random_values(ny, 4);

  std::vector<double> yd(ny), dxd(nx), dwd(nw), dbd(s.c_out);
  std::vector<float> yf(ny), dxf(nx), dwf(nw), dbf(s.c_out);
  f64::conv2d_forward(s, x.d.data(), w.d.data(), b.d.data(), yd.data());
  conv2d_forward(s, x.f.data(), w.f.data(), b.f.data(), yf.data());
  expect_close(yd, yf, "y");
  f64::conv2d_backward_input(s, dy.d.data(), w.d.data(), dxd.data());
  conv2d_backward_input(s, dy.f.data(), w.f.data(), dxf.data());
  expect_close(dxd, dxf, "dx");
  f64::conv2d_backward_weight(s, dy.d.data(), x.d.data(), dwd.data(), dbd.data());
  conv2d_backward_weight(s, dy.f.data(), x.f.data(), dwf.data(), dbf.data());
  expect_close(dwd, dwf, "dweight");
  expect_close(dbd, dbf, "dbias");
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, Conv2dF64,
    ::testing::Values(
        Conv2dShape{.n = 2, .c_in = 3, .h = 7, .w = 6, .c_out = 4, .kh = 3, .kw = 3},
        Conv2dShape{.n = 2, .c_in = 4, .h = 9, .w = 8, .c_out = 6, .kh = 3, .kw = 2,
                    .stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1},
        Conv2dShape{.n = 1, .c_in = 4, .h = 10, .w = 9, .c_out = 6, .kh = 3, .kw = 3,
                    .pad_h = 2, .pad_w = 1, .dil_h = 2, .dil_w = 3, .groups = 2},
        Conv2dShape{.n = 3, .c_in = 6, .h = 8, .w = 7, .c_out = 6, .kh = 3, .kw = 3,
                    .stride_h = 2, .stride_w = 1, .pad_h = 1, .pad_w = 1, .groups = 6},
        Conv2dShape{.n = 2, .c_in = 5, .h = 4, .w = 5, .c_out = 3, .kh = 1, .kw = 1}));

// ---- pooling -------------------------------------------------------------------------

struct PoolCase {
  int64_t n, c, h, w, kh, kw, sh, sw, ph, pw;
  int64_t out_h() const { return pool_out_size(h, kh, sh, ph); }
  int64_t out_w() const { return pool_out_size(w, kw, sw, pw); }
};

class Pool2dF64 : public ::testing::TestWithParam<PoolCase> {};

TEST_P(Pool2dF64, MaxAgreesWithFloatKernels) {
  const PoolCase p = GetParam();
  const int64_t nx = p.n * p.c * p.h * p.w, ny = p.n * p.c * p.out_h() * p.out_w();
  const Values x = distinct_values(nx, 5), dy = random_values(ny, 6);
  std::vector<double> yd(ny), dxd(nx);
  std::vector<float> yf(ny), dxf(nx);
  std::vector<int64_t> id(ny), iff(ny);
  f64::max_pool2d_forward(x.d.data(), p.n, p.c, p.h, p.w, p.kh, p.kw, p.sh, p.sw, p.ph, p.pw,
                          yd.data(), id.data());
  max_pool2d_forward(x.f.data(), p.n, p.c, p.h, p.w, p.kh, p.kw, p.sh, p.sw, p.ph, p.pw,
                     yf.data(), iff.data());
  expect_close(yd, yf, "y");
  EXPECT_EQ(id, iff);
  f64::max_pool2d_backward(dy.d.data(), id.data(), p.n, p.c, p.h, p.w, p.out_h(), p.out_w(),
                           dxd.data());
  max_pool2d_backward(dy.f.data(), iff.data(), p.n, p.c, p.h, p.w, p.out_h(), p.out_w(),
                      dxf.data());
  expect_close(dxd, dxf, "dx");
}

TEST_P(Pool2dF64, AvgAgreesWithFloatKernels) {
  const PoolCase p = GetParam();
  const int64_t nx = p.n * p.c * p.h * p.w, ny = p.n * p.c * p.out_h() * p.out_w();
  const Values x = random_values(nx, 7), dy = random_values(ny, 8);
  std::vector<double> yd(ny), dxd(nx);
  std::vector<float> yf(ny), dxf(nx);
  f64::avg_pool2d_forward(x.d.data(), p.n, p.c, p.h, p.w, p.kh, p.kw, p.sh, p.sw, p.ph, p.pw,
                          yd.data());
  avg_pool2d_forward(x.f.data(), p.n, p.c, p.h, p.w, p.kh, p.kw, p.sh, p.sw, p.ph, p.pw,
                     yf.data());
  expect_close(yd, yf, "y");
  f64::avg_pool2d_backward(dy.d.data(), p.n, p.c, p.h, p.w, p.kh, p.kw, p.sh, p.sw, p.ph, p.pw,
                           dxd.data());
  avg_pool2d_backward(dy.f.data(), p.n, p.c, p.h, p.w, p.kh, p.kw, p.sh, p.sw, p.ph, p.pw,
                      dxf.data());
  expect_close(dxd, dxf, "dx");
}

INSTANTIATE_TEST_SUITE_P(Shapes, Pool2dF64,
                         ::testing::Values(PoolCase{2, 3, 6, 5, 2, 2, 2, 2, 0, 0},
                                           PoolCase{2, 2, 7, 6, 3, 3, 2, 2, 1, 1},
                                           PoolCase{1, 3, 6, 5, 3, 2, 1, 2, 1, 0},
                                           PoolCase{2, 2, 5, 5, 3, 3, 1, 1, 1, 1}));

TEST(AdaptiveAvgPool2dF64, AgreesWithFloatKernels) {
  const int64_t n = 2, c = 3, h = 5, w = 7;
  for (auto [oh, ow] : {std::pair<int64_t, int64_t>{3, 2}, {1, 1}, {4, 9}, {5, 7}}) {
    const int64_t nx = n * c * h * w, ny = n * c * oh * ow;
    const Values x = random_values(nx, 9), dy = random_values(ny, 10);
    std::vector<double> yd(ny), dxd(nx);
    std::vector<float> yf(ny), dxf(nx);
    f64::adaptive_avg_pool2d_forward(x.d.data(), n, c, h, w, oh, ow, yd.data());
    adaptive_avg_pool2d_forward(x.f.data(), n, c, h, w, oh, ow, yf.data());
    expect_close(yd, yf, "y");
    f64::adaptive_avg_pool2d_backward(dy.d.data(), n, c, h, w, oh, ow, dxd.data());
    adaptive_avg_pool2d_backward(dy.f.data(), n, c, h, w, oh, ow, dxf.data());
    expect_close(dxd, dxf, "dx");
  }
}

TEST(Pool2dF64Errors, RejectsWhatTheFloatKernelsReject) {
  std::vector<double> x(16), y(16), dx(16);
  std::vector<int64_t> idx(4, 99);
  EXPECT_THROW(f64::max_pool2d_forward(x.data(), 1, 1, 4, 4, 2, 2, 1, 1, 2, 0, y.data(),
                                       idx.data()),
               std::invalid_argument);
  EXPECT_THROW(f64::max_pool2d_backward(y.data(), idx.data(), 1, 1, 4, 4, 2, 2, dx.data()),
               std::invalid_argument);
  EXPECT_THROW(f64::adaptive_avg_pool2d_forward(x.data(), 1, 1, 4, 4, 0, 2, y.data()),
               std::invalid_argument);
}

// ---- batch norm -------------------------------------------------------------------------

TEST(BatchNormF64, AgreesWithFloatKernels) {
  struct Case {
    int64_t n, c, h, w;
  };
  for (const Case k : {Case{4, 3, 3, 5}, Case{6, 2, 1, 1}, Case{2, 4, 7, 1}}) {
    const int64_t nx = k.n * k.c * k.h * k.w;
    // An offset mean, so that centring matters.
    const Values x = random_values(nx, 11, 1.0, 3.0), dy = random_values(nx, 12);
    const Values g = random_values(k.c, 13, 0.5, 1.5), b = random_values(k.c, 14);
    const Values rm0 = random_values(k.c, 15), rv0 = random_values(k.c, 16, 0.5, 2.0);
    const double eps = 1e-5, momentum = 0.1;

    std::vector<double> yd(nx), smd(k.c), sid(k.c), rmd = rm0.d, rvd = rv0.d;
    std::vector<float> yf(nx), smf(k.c), sif(k.c), rmf = rm0.f, rvf = rv0.f;
    f64::batch_norm_forward_train(x.d.data(), k.n, k.c, k.h, k.w, g.d.data(), b.d.data(), eps,
                                  momentum, rmd.data(), rvd.data(), yd.data(), smd.data(),
                                  sid.data());
    batch_norm_forward_train(x.f.data(), k.n, k.c, k.h, k.w, g.f.data(), b.f.data(),
                             static_cast<float>(eps), static_cast<float>(momentum), rmf.data(),
                             rvf.data(), yf.data(), smf.data(), sif.data());
    expect_close(yd, yf, "train y");
    expect_close(smd, smf, "save_mean");
    expect_close(sid, sif, "save_invstd");
    expect_close(rmd, rmf, "running_mean");
    expect_close(rvd, rvf, "running_var");

    std::vector<double> dxd(nx), dgd(k.c), dbd(k.c);
    std::vector<float> dxf(nx), dgf(k.c), dbf(k.c);
    f64::batch_norm_backward(dy.d.data(), x.d.data(), k.n, k.c, k.h, k.w, g.d.data(), smd.data(),
                             sid.data(), dxd.data(), dgd.data(), dbd.data());
    batch_norm_backward(dy.f.data(), x.f.data(), k.n, k.c, k.h, k.w, g.f.data(), smf.data(),
                        sif.data(), dxf.data(), dgf.data(), dbf.data());
    expect_close(dxd, dxf, "dx");
    expect_close(dgd, dgf, "dgamma");
    expect_close(dbd, dbf, "dbeta");

    f64::batch_norm_forward_eval(x.d.data(), k.n, k.c, k.h, k.w, g.d.data(), nullptr,
                                 rm0.d.data(), rv0.d.data(), eps, yd.data());
    batch_norm_forward_eval(x.f.data(), k.n, k.c, k.h, k.w, g.f.data(), nullptr, rm0.f.data(),
                            rv0.f.data(), static_cast<float>(eps), yf.data());
    expect_close(yd, yf, "eval y");
  }
}

TEST(BatchNormF64, TrainingNeedsTwoValuesPerChannel) {
  std::vector<double> x(3), y(3), sm(3), si(3);
  EXPECT_THROW(f64::batch_norm_forward_train(x.data(), 1, 3, 1, 1, nullptr, nullptr, 1e-5, 0.1,
                                             nullptr, nullptr, y.data(), sm.data(), si.data()),
               std::invalid_argument);
}

}  // namespace
}  // namespace chorus::cpu
