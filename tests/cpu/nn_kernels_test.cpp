// The CPU kernel-set wrappers for convolution, pooling and batch norm
// (cpu/nn_kernels.cpp) against naive double references written here from the
// definitions, in float32 and in bfloat16 (which the wrappers route through
// float32 temporaries). Batch-norm gradients are checked against central
// finite differences of the double forward. The raw float kernels have their
// own thorough tests; these check the wrapping: geometry, argument order,
// optional tensors, dtype round trips, error translation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "chorus/core/error.h"
#include "chorus/cpu/kernels.h"
#include "testing/random.h"

namespace chorus::cpu {
namespace {

using Vec = std::vector<double>;

Tensor empty(const Shape& s, DType dt) {
  return detail::empty_tensor(s, dt, Device(DeviceType::CPU, 0));
}

Tensor tensor_of(const Shape& s, DType dt, const Vec& v) {
  Tensor t = empty(s, dt);
  for (size_t i = 0; i < v.size(); ++i) {
    if (dt == kBFloat16) {
      t.data<BFloat16>()[i] = BFloat16(static_cast<float>(v[i]));
    } else {
      t.data<float>()[i] = static_cast<float>(v[i]);
    }
  }
  return t;
}

Vec values_of(const Tensor& t) {
  Vec v(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i)
    v[i] = t.dtype() == kBFloat16 ? static_cast<float>(t.data<BFloat16>()[i]) : t.data<float>()[i];
  return v;
}

// Random values as `dt` stores them, so references see the kernels' inputs.
Vec random_vec(size_t n, uint32_t seed, DType dt) {
  return values_of(tensor_of({int64_t(n)}, dt, chorus::testing::random_doubles(n, seed)));
}

double tolerance(DType dt) { return dt == kBFloat16 ? 1e-2 : 1e-4; }

void expect_close(const Vec& got, const Vec& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], tol * std::max(1.0, std::abs(want[i]))) << what << " at " << i;
}

const DType kDTypes[] = {kFloat32, kBFloat16};

// ---- convolution -------------------------------------------------------------

// Visits every (output, weight, input) index triple the convolution multiplies.
void for_each_tap(const Conv2dGeometry& g, const std::function<void(int64_t, int64_t, int64_t)>& f) {
  const int64_t oh = g.out_h(), ow = g.out_w();
  const int64_t cin_g = g.c_in / g.groups, cout_g = g.c_out / g.groups;
  for (int64_t b = 0; b < g.n; ++b)
    for (int64_t co = 0; co < g.c_out; ++co)
      for (int64_t oy = 0; oy < oh; ++oy)
        for (int64_t ox = 0; ox < ow; ++ox)
          for (int64_t cl = 0; cl < cin_g; ++cl)
            for (int64_t ki = 0; ki < g.kh; ++ki)
              for (int64_t kj = 0; kj < g.kw; ++kj) {
                const int64_t iy = oy * g.stride_h - g.pad_h + ki * g.dil_h;
                const int64_t ix = ox * g.stride_w - g.pad_w + kj * g.dil_w;
                if (iy < 0 || iy >= g.h || ix < 0 || ix >= g.w) continue;
                const int64_t ci = (co / cout_g) * cin_g + cl;
                f(((b * g.c_out + co) * oh + oy) * ow + ox, ((co * cin_g + cl) * g.kh + ki) * g.kw + kj,
                  ((b * g.c_in + ci) * g.h + iy) * g.w + ix);
              }
}

TEST(NnKernelsCpu, Conv2dForwardAndBackwardMatchNaive) {
  Conv2dGeometry g{.n = 2, .c_in = 4, .h = 7, .w = 6, .c_out = 6, .kh = 3, .kw = 2};
  g.stride_h = 2, g.pad_h = 1, g.pad_w = 1, g.dil_w = 2, g.groups = 2;
  const Shape xs = {g.n, g.c_in, g.h, g.w}, ws = {g.c_out, g.c_in / g.groups, g.kh, g.kw};
  const Shape ys = {g.n, g.c_out, g.out_h(), g.out_w()}, bs = {g.c_out};
  for (DType dt : kDTypes) {
    const std::string what = dtype_name(dt);
    const Vec x = random_vec(numel_of(xs), 1, dt), w = random_vec(numel_of(ws), 2, dt);
    const Vec b = random_vec(g.c_out, 3, dt), dy = random_vec(numel_of(ys), 4, dt);
    Vec y_ref(numel_of(ys)), dx_ref(x.size(), 0.0), dw_ref(w.size(), 0.0), db_ref(g.c_out, 0.0);
    const int64_t plane = g.out_h() * g.out_w();
    for (size_t i = 0; i < y_ref.size(); ++i) {
      y_ref[i] = b[(i / plane) % g.c_out];
      db_ref[(i / plane) % g.c_out] += dy[i];
    }
    for_each_tap(g, [&](int64_t yi, int64_t wi, int64_t xi) {
      y_ref[yi] += w[wi] * x[xi];
      dx_ref[xi] += w[wi] * dy[yi];
      dw_ref[wi] += x[xi] * dy[yi];
    });

    Tensor y = empty(ys, dt), dx = empty(xs, dt), dw = empty(ws, dt), db = empty(bs, dt);
    conv2d_forward(g, tensor_of(xs, dt, x), tensor_of(ws, dt, w), tensor_of(bs, dt, b), y);
    conv2d_backward_input(g, tensor_of(ys, dt, dy), tensor_of(ws, dt, w), dx);
    conv2d_backward_weight(g, tensor_of(ys, dt, dy), tensor_of(xs, dt, x), dw, db);
    expect_close(values_of(y), y_ref, tolerance(dt), what + " y");
    expect_close(values_of(dx), dx_ref, tolerance(dt), what + " dx");
    expect_close(values_of(dw), dw_ref, tolerance(dt), what + " dweight");
    expect_close(values_of(db), db_ref, tolerance(dt), what + " dbias");

    // Undefined bias / dbias are allowed.
    Tensor y_nobias = empty(ys, dt);
    conv2d_forward(g, tensor_of(xs, dt, x), tensor_of(ws, dt, w), Tensor(), y_nobias);
    Vec want = y_ref;
    for (size_t i = 0; i < want.size(); ++i) want[i] -= b[(i / plane) % g.c_out];
    expect_close(values_of(y_nobias), want, tolerance(dt), what + " y without bias");
    conv2d_backward_weight(g, tensor_of(ys, dt, dy), tensor_of(xs, dt, x), dw, Tensor());
    expect_close(values_of(dw), dw_ref, tolerance(dt), what + " dweight without dbias");
  }
}

TEST(NnKernelsCpu, Conv2dBadArgumentsThrowValueError) {
  Conv2dGeometry g{.n = 1, .c_in = 3, .h = 5, .w = 5, .c_out = 4, .kh = 3, .kw = 3};
  Tensor x = tensor_of({1, 3, 5, 5}, kFloat32, random_vec(75, 5, kFloat32));
  Tensor w = tensor_of({4, 3, 3, 3}, kFloat32, random_vec(108, 6, kFloat32));
  EXPECT_THROW(conv2d_forward(g, x, w, Tensor(), empty({1, 4, 5, 5}, kFloat32)), ValueError);
  g.groups = 2;  // 3 channels do not split into 2 groups: the raw kernel's check
  EXPECT_THROW(conv2d_forward(g, x, w, Tensor(), empty({1, 4, 3, 3}, kFloat32)), ValueError);
}

// ---- pooling -------------------------------------------------------------------

TEST(NnKernelsCpu, MaxAndAvgPoolMatchNaive) {
  const Pool2dGeometry g{.n = 2, .c = 3, .h = 7, .w = 6, .kh = 3, .kw = 2,
                         .stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1};
  const int64_t oh = g.out_h(), ow = g.out_w();
  const Shape xs = {g.n, g.c, g.h, g.w}, ys = {g.n, g.c, oh, ow};
  for (DType dt : kDTypes) {
    const std::string what = dtype_name(dt);
    const Vec x = random_vec(numel_of(xs), 7, dt), dy = random_vec(numel_of(ys), 8, dt);
    Vec max_ref(numel_of(ys)), avg_ref(numel_of(ys)), dx_ref(x.size(), 0.0);
    std::vector<int64_t> idx_ref(numel_of(ys));
    for (int64_t p = 0; p < g.n * g.c; ++p)
      for (int64_t oy = 0; oy < oh; ++oy)
        for (int64_t ox = 0; ox < ow; ++ox) {
          const int64_t o = (p * oh + oy) * ow + ox;
          double best = -std::numeric_limits<double>::infinity(), sum = 0;
          for (int64_t i = 0; i < g.kh; ++i)
            for (int64_t j = 0; j < g.kw; ++j) {
              const int64_t iy = oy * g.stride_h - g.pad_h + i, ix = ox * g.stride_w - g.pad_w + j;
              if (iy < 0 || iy >= g.h || ix < 0 || ix >= g.w) continue;  // padding: 0 in the sum
              const double v = x[p * g.h * g.w + iy * g.w + ix];
              sum += v;
              if (v > best) best = v, idx_ref[o] = iy * g.w + ix;
            }
          max_ref[o] = best;
          avg_ref[o] = sum / double(g.kh * g.kw);  // count_include_pad
          dx_ref[p * g.h * g.w + idx_ref[o]] += dy[o];
        }

    Tensor y = empty(ys, dt), indices = empty(ys, kInt64), dx = empty(xs, dt);
    max_pool2d_forward(g, tensor_of(xs, dt, x), y, indices);
    expect_close(values_of(y), max_ref, tolerance(dt), what + " max");
    EXPECT_EQ(std::vector<int64_t>(indices.data<int64_t>(), indices.data<int64_t>() + idx_ref.size()),
              idx_ref) << what;
    max_pool2d_backward(g, tensor_of(ys, dt, dy), indices, dx);
    expect_close(values_of(dx), dx_ref, tolerance(dt), what + " max backward");

    Tensor avg = empty(ys, dt);
    avg_pool2d_forward(g, tensor_of(xs, dt, x), avg);
    expect_close(values_of(avg), avg_ref, tolerance(dt), what + " avg");

    // Adaptive average to 1x1 is the global mean of each plane.
    Tensor global = empty({g.n, g.c, 1, 1}, dt);
    adaptive_avg_pool2d_forward(tensor_of(xs, dt, x), global);
    Vec mean_ref(g.n * g.c, 0.0);
    for (size_t i = 0; i < x.size(); ++i) mean_ref[i / (g.h * g.w)] += x[i] / double(g.h * g.w);
    expect_close(values_of(global), mean_ref, tolerance(dt), what + " adaptive avg");
  }
}

// ---- batch norm ------------------------------------------------------------------

struct BnRef {
  Vec y, mean, invstd, running_mean, running_var;
};

// PyTorch's training-mode batch norm on [N, C, S] (S = spatial), in double.
BnRef ref_batch_norm(const Vec& x, const Vec& gamma, const Vec& beta, const Vec& rm,
                     const Vec& rv, int64_t n, int64_t c, int64_t s, double momentum, double eps) {
  BnRef r{Vec(x.size()), Vec(c), Vec(c), rm, rv};
  const double count = double(n * s);
  for (int64_t ch = 0; ch < c; ++ch) {
    double sum = 0, sq = 0;
    for (int64_t b = 0; b < n; ++b)
      for (int64_t i = 0; i < s; ++i) sum += x[(b * c + ch) * s + i];
    const double mean = sum / count;
    for (int64_t b = 0; b < n; ++b)
      for (int64_t i = 0; i < s; ++i) sq += std::pow(x[(b * c + ch) * s + i] - mean, 2);
    const double var = sq / count, invstd = 1 / std::sqrt(var + eps);
    r.mean[ch] = mean;
    r.invstd[ch] = invstd;
    r.running_mean[ch] = (1 - momentum) * rm[ch] + momentum * mean;
    r.running_var[ch] = (1 - momentum) * rv[ch] + momentum * sq / (count - 1);
    for (int64_t b = 0; b < n; ++b)
      for (int64_t i = 0; i < s; ++i) {
        const int64_t k = (b * c + ch) * s + i;
        r.y[k] = (x[k] - mean) * invstd * gamma[ch] + beta[ch];
      }
  }
  return r;
}

// d/dv of sum(w * f(v)) by central differences.
Vec finite_difference_grad(const std::function<Vec(const Vec&)>& f, Vec v, const Vec& w) {
  const double h = 1e-6;
  Vec g(v.size());
  auto weighted = [&](const Vec& at) {
    const Vec y = f(at);
    double s = 0;
    for (size_t i = 0; i < y.size(); ++i) s += w[i] * y[i];
    return s;
  };
  for (size_t i = 0; i < v.size(); ++i) {
    const double keep = v[i];
    v[i] = keep + h;
    const double up = weighted(v);
    v[i] = keep - h;
    const double down = weighted(v);
    v[i] = keep;
    g[i] = (up - down) / (2 * h);
  }
  return g;
}

TEST(NnKernelsCpu, BatchNormTrainingForwardAndBackwardMatchNaive) {
  const int64_t n = 3, c = 4, s = 10;  // x [3, 4, 2, 5]: spatial dims flattened
  const Shape xs = {n, c, 2, 5};
  const double momentum = 0.1, eps = 1e-5;
  for (DType dt : kDTypes) {
    const std::string what = dtype_name(dt);
    const Vec x = random_vec(n * c * s, 9, dt), dy = random_vec(n * c * s, 10, dt);
    const Vec gamma = random_vec(c, 11, dt), beta = random_vec(c, 12, dt);
    Vec rm = random_vec(c, 13, kFloat32), rv = random_vec(c, 14, kFloat32);
    for (double& v : rv) v = std::abs(v) + 0.5;
    const BnRef want = ref_batch_norm(x, gamma, beta, rm, rv, n, c, s, momentum, eps);

    Tensor y = empty(xs, dt), save_mean = empty({c}, kFloat32), save_invstd = empty({c}, kFloat32);
    Tensor running_mean = tensor_of({c}, kFloat32, rm), running_var = tensor_of({c}, kFloat32, rv);
    const Tensor xt = tensor_of(xs, dt, x), gt = tensor_of({c}, dt, gamma);
    batch_norm_forward(xt, gt, tensor_of({c}, dt, beta), running_mean, running_var, true,
                       momentum, eps, y, save_mean, save_invstd);
    expect_close(values_of(y), want.y, tolerance(dt), what + " y");
    expect_close(values_of(save_mean), want.mean, 1e-5, what + " save_mean");
    expect_close(values_of(save_invstd), want.invstd, 1e-4, what + " save_invstd");
    expect_close(values_of(running_mean), want.running_mean, 1e-5, what + " running_mean");
    expect_close(values_of(running_var), want.running_var, 1e-5, what + " running_var");

    auto loss_of = [&](const Vec& xv, const Vec& gv, const Vec& bv) {
      return ref_batch_norm(xv, gv, bv, rm, rv, n, c, s, momentum, eps).y;
    };
    const Vec dx_ref = finite_difference_grad([&](const Vec& v) { return loss_of(v, gamma, beta); }, x, dy);
    const Vec dg_ref = finite_difference_grad([&](const Vec& v) { return loss_of(x, v, beta); }, gamma, dy);
    const Vec db_ref = finite_difference_grad([&](const Vec& v) { return loss_of(x, gamma, v); }, beta, dy);
    Tensor dx = empty(xs, dt), dgamma = empty({c}, dt), dbeta = empty({c}, dt);
    batch_norm_backward(tensor_of(xs, dt, dy), xt, gt, save_mean, save_invstd, dx, dgamma, dbeta);
    expect_close(values_of(dx), dx_ref, tolerance(dt), what + " dx");
    expect_close(values_of(dgamma), dg_ref, tolerance(dt), what + " dgamma");
    expect_close(values_of(dbeta), db_ref, tolerance(dt), what + " dbeta");
  }
}

TEST(NnKernelsCpu, BatchNormWithoutAffineOrRunningStatsAndInEval) {
  const int64_t n = 8, c = 3;  // 2-d input [N, C]
  const Vec x = random_vec(n * c, 15, kFloat32);
  const Vec ones(c, 1.0), zeros(c, 0.0);
  const BnRef want = ref_batch_norm(x, ones, zeros, zeros, ones, n, c, 1, 0.1, 1e-5);
  Tensor y = empty({n, c}, kFloat32), mean = empty({c}, kFloat32), invstd = empty({c}, kFloat32);
  batch_norm_forward(tensor_of({n, c}, kFloat32, x), Tensor(), Tensor(), Tensor(), Tensor(), true,
                     0.1, 1e-5, y, mean, invstd);
  expect_close(values_of(y), want.y, 1e-4, "no affine, no running stats");

  // Eval: normalise with the running statistics instead.
  const Vec rm = random_vec(c, 16, kFloat32), rv = {0.5, 1.5, 2.0};
  Tensor y_eval = empty({n, c}, kFloat32);
  batch_norm_forward(tensor_of({n, c}, kFloat32, x), Tensor(), Tensor(),
                     tensor_of({c}, kFloat32, rm), tensor_of({c}, kFloat32, rv), false, 0.1, 1e-5,
                     y_eval, Tensor(), Tensor());
  Vec eval_ref(x.size());
  for (size_t i = 0; i < x.size(); ++i) eval_ref[i] = (x[i] - rm[i % c]) / std::sqrt(rv[i % c] + 1e-5);
  expect_close(values_of(y_eval), eval_ref, 1e-5, "eval");
  EXPECT_THROW(batch_norm_forward(tensor_of({n, c}, kFloat32, x), Tensor(), Tensor(), Tensor(),
                                  Tensor(), false, 0.1, 1e-5, y_eval, Tensor(), Tensor()),
               ValueError);
}

}  // namespace
}  // namespace chorus::cpu
