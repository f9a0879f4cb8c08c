// Forward values of the neural-network ops against naive references written
// here from the definitions (in double): linear, conv2d, pools, batch norm,
// softmax, cross entropy, MSE, dropout; and errors that name the op.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include <chorus/chorus.h>

#include "testing/compare.h"
#include "testing/expect_error.h"
#include "testing/gradcheck.h"

namespace chorus {
namespace {

using test::throws_naming;

namespace F = nn::functional;
using F::Conv2dParams;
using F::Pool2dParams;
using test::uniform_values;

Tensor rnd(const Shape& s, uint64_t seed, double lo = -1, double hi = 1) {
  return from_vector(uniform_values(numel_of(s), seed, lo, hi), s);
}
Tensor ints(const std::vector<int64_t>& v, const Shape& s) { return from_vector(v, s); }

void expect_close(const std::vector<float>& got, const std::vector<double>& want, double tol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], want[i], tol * std::max(1.0, std::abs(want[i]))) << "element " << i;
}

// ---- linear and convolution ---------------------------------------------------------

TEST(OpsNN, LinearMatchesNaive) {
  Tensor x = rnd({2, 3, 4}, 1), w = rnd({5, 4}, 2), b = rnd({5}, 3);
  std::vector<float> xv = x.to_vector<float>(), wv = w.to_vector<float>(), bv = b.to_vector<float>();
  std::vector<double> want(2 * 3 * 5);
  for (int64_t r = 0; r < 6; ++r)
    for (int64_t o = 0; o < 5; ++o) {
      double s = bv[o];
      for (int64_t i = 0; i < 4; ++i) s += static_cast<double>(xv[r * 4 + i]) * wv[o * 4 + i];
      want[r * 5 + o] = s;
    }
  Tensor y = F::linear(x, w, b);
  EXPECT_EQ(y.sizes(), (Shape{2, 3, 5}));
  expect_close(y.to_vector<float>(), want, 1e-6);
  std::vector<float> nob = F::linear(x, w, Tensor()).to_vector<float>();
  for (size_t i = 0; i < nob.size(); ++i) EXPECT_NEAR(nob[i], want[i] - bv[i % 5], 1e-5);
}

struct ConvCase {
  Shape x, w;
  Conv2dParams p;
  bool bias;
};

std::vector<double> naive_conv2d(const Tensor& x, const Tensor& w, const Tensor& b, const Conv2dParams& p) {
  const int64_t n = x.size(0), ci = x.size(1), h = x.size(2), wd = x.size(3);
  const int64_t co = w.size(0), cig = w.size(1), kh = w.size(2), kw = w.size(3);
  const int64_t oh = (h + 2 * p.pad_h - p.dil_h * (kh - 1) - 1) / p.stride_h + 1;
  const int64_t ow = (wd + 2 * p.pad_w - p.dil_w * (kw - 1) - 1) / p.stride_w + 1;
  const int64_t cog = co / p.groups;
  std::vector<float> xv = x.to_vector<float>(), wv = w.to_vector<float>();
  std::vector<float> bv = b.defined() ? b.to_vector<float>() : std::vector<float>(co, 0.0f);
  std::vector<double> y(n * co * oh * ow);
  for (int64_t in = 0; in < n; ++in)
    for (int64_t o = 0; o < co; ++o)
      for (int64_t oy = 0; oy < oh; ++oy)
        for (int64_t ox = 0; ox < ow; ++ox) {
          double s = bv[o];
          const int64_t g = o / cog;
          for (int64_t c = 0; c < cig; ++c)
            for (int64_t ky = 0; ky < kh; ++ky)
              for (int64_t kx = 0; kx < kw; ++kx) {
                int64_t iy = oy * p.stride_h - p.pad_h + ky * p.dil_h, ix = ox * p.stride_w - p.pad_w + kx * p.dil_w;
                if (iy < 0 || iy >= h || ix < 0 || ix >= wd) continue;
                s += static_cast<double>(xv[((in * ci + g * cig + c) * h + iy) * wd + ix]) *
                     wv[((o * cig + c) * kh + ky) * kw + kx];
              }
          y[((in * co + o) * oh + oy) * ow + ox] = s;
        }
  return y;
}

TEST(OpsNN, Conv2dMatchesNaive) {
  std::vector<ConvCase> cases = {
      {{2, 3, 7, 6}, {4, 3, 3, 3}, {}, true},
      {{1, 4, 8, 8}, {6, 2, 3, 3}, {2, 2, 1, 1, 1, 1, 2}, true},       // stride 2, pad 1, groups 2
      {{2, 2, 9, 7}, {3, 2, 3, 2}, {1, 2, 2, 0, 2, 1, 1}, false},      // dilation, asymmetric
      {{1, 4, 5, 5}, {4, 1, 3, 3}, {1, 1, 1, 1, 1, 1, 4}, true},       // depthwise
      {{3, 8, 4, 4}, {5, 8, 1, 1}, {}, true},                          // 1x1
      {{2, 3, 6, 6}, {2, 3, 6, 6}, {}, false},                         // kernel covers the input
  };
  for (const ConvCase& c : cases) {
    SCOPED_TRACE(shape_str(c.x) + " * " + shape_str(c.w));
    Tensor x = rnd(c.x, 4), w = rnd(c.w, 5), b = c.bias ? rnd({c.w[0]}, 6) : Tensor();
    Tensor y = F::conv2d(x, w, b, c.p);
    expect_close(y.to_vector<float>(), naive_conv2d(x, w, b, c.p), 1e-5);
  }
  // Non-contiguous input (a channels-slice view) and a layer on cpu:1.
  Tensor big = rnd({2, 6, 5, 5}, 7), w = rnd({2, 3, 3, 3}, 8);
  Tensor xs = big.narrow(1, 2, 3);
  expect_close(F::conv2d(xs, w, Tensor(), {}).to_vector<float>(), naive_conv2d(xs.contiguous(), w, Tensor(), {}), 1e-5);
  nn::Conv2d layer({3, 2, 3});
  layer.to(Device("cpu:1"));
  Tensor y1 = layer.forward(xs.to(Device("cpu:1")));
  EXPECT_EQ(y1.device(), cpu_device(1));
  expect_close(y1.to_vector<float>(), naive_conv2d(xs.contiguous(), layer.weight(), layer.bias(), {}), 1e-5);
}

// ---- pooling -----------------------------------------------------------------------------

std::vector<double> naive_pool(const Tensor& x, const Pool2dParams& p, bool max) {
  const int64_t n = x.size(0) * x.size(1), h = x.size(2), w = x.size(3);
  const int64_t oh = (h + 2 * p.pad_h - p.kh) / p.stride_h + 1, ow = (w + 2 * p.pad_w - p.kw) / p.stride_w + 1;
  std::vector<float> xv = x.to_vector<float>();
  std::vector<double> y(n * oh * ow);
  for (int64_t c = 0; c < n; ++c)
    for (int64_t oy = 0; oy < oh; ++oy)
      for (int64_t ox = 0; ox < ow; ++ox) {
        double acc = max ? -std::numeric_limits<double>::infinity() : 0.0;
        for (int64_t ky = 0; ky < p.kh; ++ky)
          for (int64_t kx = 0; kx < p.kw; ++kx) {
            int64_t iy = oy * p.stride_h - p.pad_h + ky, ix = ox * p.stride_w - p.pad_w + kx;
            if (iy < 0 || iy >= h || ix < 0 || ix >= w) continue;  // padding: never the max, adds 0
            double v = xv[(c * h + iy) * w + ix];
            acc = max ? std::max(acc, v) : acc + v;
          }
        // count_include_pad: the divisor is the whole window.
        y[(c * oh + oy) * ow + ox] = max ? acc : acc / static_cast<double>(p.kh * p.kw);
      }
  return y;
}

TEST(OpsNN, PoolsMatchNaive) {
  Tensor x = rnd({2, 3, 7, 6}, 9);
  for (Pool2dParams p : std::vector<Pool2dParams>{{2, 2, 2, 2}, {3, 3, 2, 2, 1, 1}, {3, 2, 1, 2, 1, 1}, {7, 6, 1, 1}}) {
    SCOPED_TRACE(std::to_string(p.kh) + "x" + std::to_string(p.kw) + " s" + std::to_string(p.stride_h) + " p" +
                 std::to_string(p.pad_h));
    Tensor mx = F::max_pool2d(x, p), av = F::avg_pool2d(x, p);
    expect_close(mx.to_vector<float>(), naive_pool(x, p, true), 0);
    expect_close(av.to_vector<float>(), naive_pool(x, p, false), 1e-6);
  }
  nn::MaxPool2d layer({2});  // stride defaults to the kernel
  EXPECT_EQ(layer.forward(x).sizes(), (Shape{2, 3, 3, 3}));
  nn::AvgPool2d avg({3, 1, 1});
  EXPECT_EQ(avg.forward(x).sizes(), (Shape{2, 3, 7, 6}));
}

TEST(OpsNN, AdaptiveAvgPoolMatchesNaive) {
  Tensor x = rnd({2, 2, 5, 7}, 10);
  std::vector<float> xv = x.to_vector<float>();
  for (auto [oh, ow] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {3, 2}, {5, 7}, {4, 9}}) {
    SCOPED_TRACE(std::to_string(oh) + "x" + std::to_string(ow));
    std::vector<double> want;
    for (int64_t c = 0; c < 4; ++c)
      for (int64_t i = 0; i < oh; ++i)
        for (int64_t j = 0; j < ow; ++j) {
          int64_t y0 = static_cast<int64_t>(std::floor(i * 5.0 / oh)), y1 = static_cast<int64_t>(std::ceil((i + 1) * 5.0 / oh));
          int64_t x0 = static_cast<int64_t>(std::floor(j * 7.0 / ow)), x1 = static_cast<int64_t>(std::ceil((j + 1) * 7.0 / ow));
          double s = 0;
          for (int64_t a = y0; a < y1; ++a)
            for (int64_t b = x0; b < x1; ++b) s += xv[(c * 5 + a) * 7 + b];
          want.push_back(s / static_cast<double>((y1 - y0) * (x1 - x0)));
        }
    Tensor y = F::adaptive_avg_pool2d(x, oh, ow);
    EXPECT_EQ(y.sizes(), (Shape{2, 2, oh, ow}));
    expect_close(y.to_vector<float>(), want, 1e-6);
  }
  // Global average pooling is the mean over H and W.
  expect_close(F::adaptive_avg_pool2d(x, 1, 1).to_vector<float>(),
               [&] {
                 std::vector<float> m = x.mean({2, 3}).to_vector<float>();
                 return std::vector<double>(m.begin(), m.end());
               }(),
               1e-6);
}

// ---- batch norm --------------------------------------------------------------------------

TEST(OpsNN, BatchNormTrainingMatchesTheClosedForm) {
  const int64_t n = 4, c = 3, hw = 5;
  Tensor x = rnd({n, c, 1, hw}, 11, -2, 3), w = rnd({c}, 12, 0.5, 1.5), b = rnd({c}, 13);
  Tensor rm = rnd({c}, 14), rv = rnd({c}, 15, 0.5, 2);
  std::vector<float> xv = x.to_vector<float>(), wv = w.to_vector<float>(), bv = b.to_vector<float>();
  std::vector<float> rm0 = rm.to_vector<float>(), rv0 = rv.to_vector<float>();
  const double eps = 1e-5, momentum = 0.1;
  Tensor y = F::batch_norm(x, rm, rv, w, b, true, momentum, eps);
  std::vector<float> yv = y.to_vector<float>(), rm1 = rm.to_vector<float>(), rv1 = rv.to_vector<float>();
  for (int64_t ch = 0; ch < c; ++ch) {
    double mean = 0, var = 0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t k = 0; k < hw; ++k) mean += xv[(i * c + ch) * hw + k];
    mean /= n * hw;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t k = 0; k < hw; ++k) var += std::pow(xv[(i * c + ch) * hw + k] - mean, 2);
    const double biased = var / (n * hw), unbiased = var / (n * hw - 1);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t k = 0; k < hw; ++k) {
        int64_t at = (i * c + ch) * hw + k;
        double want = (xv[at] - mean) / std::sqrt(biased + eps) * wv[ch] + bv[ch];
        EXPECT_NEAR(yv[at], want, 1e-5);
      }
    // PyTorch's rule: running = (1 - momentum) * running + momentum * batch statistic (unbiased variance).
    EXPECT_NEAR(rm1[ch], (1 - momentum) * rm0[ch] + momentum * mean, 1e-6);
    EXPECT_NEAR(rv1[ch], (1 - momentum) * rv0[ch] + momentum * unbiased, 1e-6);
  }
}

TEST(OpsNN, BatchNormEvalUsesRunningStatistics) {
  Tensor x = rnd({3, 2, 2, 2}, 16), w = rnd({2}, 17), b = rnd({2}, 18);
  Tensor rm = from_vector(std::vector<float>{0.25f, -0.5f}, {2}), rv = from_vector(std::vector<float>{0.5f, 2.0f}, {2});
  std::vector<float> xv = x.to_vector<float>(), wv = w.to_vector<float>(), bv = b.to_vector<float>();
  Tensor y = F::batch_norm(x, rm, rv, w, b, false, 0.1, 1e-5);
  std::vector<float> yv = y.to_vector<float>();
  const double m[2] = {0.25, -0.5}, v[2] = {0.5, 2.0};
  for (int64_t i = 0; i < 24; ++i) {
    int64_t ch = (i / 4) % 2;
    EXPECT_NEAR(yv[i], (xv[i] - m[ch]) / std::sqrt(v[ch] + 1e-5) * wv[ch] + bv[ch], 1e-5);
  }
  EXPECT_EQ(rm.to_vector<float>(), (std::vector<float>{0.25f, -0.5f}));  // untouched in eval
  EXPECT_EQ(rv.to_vector<float>(), (std::vector<float>{0.5f, 2.0f}));
  // Without weight and bias.
  std::vector<float> plain = F::batch_norm(x, rm, rv, Tensor(), Tensor(), false, 0.1, 1e-5).to_vector<float>();
  for (int64_t i = 0; i < 24; ++i) {
    int64_t ch = (i / 4) % 2;
    EXPECT_NEAR(plain[i], (xv[i] - m[ch]) / std::sqrt(v[ch] + 1e-5), 1e-5);
  }
}

// Evaluation under NoGradGuard runs the fused kernel alone, although the
// parameters require grad (it used to also build the differentiable
// composition: four more tensors of the input's size, and three times the
// time; chorus train's evaluation spent most of its time there). With the
// graph on, the gradient still reaches the parameters.
TEST(OpsNN, BatchNormEvalWithoutGraphAllocatesOnlyItsOutput) {
  Tensor x = rnd({8, 16, 32, 32}, 21), w = rnd({16}, 22), b = rnd({16}, 23);
  Tensor rm = rnd({16}, 24), rv = rnd({16}, 25, 0.5, 1.5);
  w.set_requires_grad(true);
  b.set_requires_grad(true);
  const size_t xbytes = static_cast<size_t>(x.numel()) * sizeof(float);
  DeviceBackend& cpu = backend(x.device());
  Tensor y;
  {
    NoGradGuard ng;
    const size_t before = cpu.bytes_in_use(x.device());
    cpu.reset_peak_bytes(x.device());
    y = F::batch_norm(x, rm, rv, w, b, false, 0.1, 1e-5);
    EXPECT_LE(cpu.peak_bytes(x.device()) - before, xbytes + 4096) << "more than the output was allocated";
    EXPECT_FALSE(y.requires_grad());
  }
  Tensor yg = F::batch_norm(x, rm, rv, w, b, false, 0.1, 1e-5);
  ASSERT_TRUE(yg.requires_grad());
  EXPECT_LE(test::rel_err(y, yg.detach()), 1e-6);
  yg.sum().backward();
  // d sum(y) / d beta = the count per channel; / d gamma = sum of xhat.
  std::vector<float> gb = b.grad().to_vector<float>();
  for (float g : gb) EXPECT_NEAR(g, 8 * 32 * 32, 1e-2);
}

// ---- softmax, losses, dropout ----------------------------------------------------------

TEST(OpsNN, SoftmaxRowsSumToOneAndMatchTheDefinition) {
  Tensor x = rnd({2, 5, 3}, 19, -4, 4);
  std::vector<float> xv = x.to_vector<float>();
  for (int64_t dim : {0, 1, 2, -1}) {
    SCOPED_TRACE(dim);
    int64_t d = dim < 0 ? dim + 3 : dim;
    Tensor s = softmax(x, dim), ls = log_softmax(x, dim);
    EXPECT_EQ(s.sizes(), x.sizes());
    std::vector<float> sum = s.sum({d}).to_vector<float>();
    for (float v : sum) EXPECT_NEAR(v, 1.0, 1e-6);
    std::vector<float> sv = s.to_vector<float>(), lv = ls.to_vector<float>();
    const Shape sh = {2, 5, 3};
    const int64_t stride = d == 0 ? 15 : d == 1 ? 3 : 1;
    for (int64_t i = 0; i < 30; ++i) {
      int64_t coord = (i / stride) % sh[d];
      int64_t first = i - coord * stride;
      double mx = -INFINITY, z = 0;
      for (int64_t k = 0; k < sh[d]; ++k) mx = std::max(mx, static_cast<double>(xv[first + k * stride]));
      for (int64_t k = 0; k < sh[d]; ++k) z += std::exp(xv[first + k * stride] - mx);
      EXPECT_NEAR(sv[i], std::exp(xv[i] - mx) / z, 1e-6);
      EXPECT_NEAR(lv[i], xv[i] - mx - std::log(z), 1e-5);
    }
  }
  // Large logits do not overflow.
  Tensor big = from_vector(std::vector<float>{1000, 1001, 1002}, {3});
  std::vector<float> bs = softmax(big, 0).to_vector<float>();
  for (float v : bs) EXPECT_TRUE(std::isfinite(v));
  EXPECT_NEAR(bs[2], 1 / (1 + std::exp(-1.0) + std::exp(-2.0)), 1e-6);
  EXPECT_NEAR(log_softmax(big, 0).to_vector<float>()[0], -2 - std::log(1 + std::exp(-1.0) + std::exp(-2.0)), 1e-4);
}

TEST(OpsNN, CrossEntropyMatchesTheClosedForm) {
  Tensor logits = rnd({4, 5}, 20, -3, 3);
  std::vector<int64_t> t = {1, 0, 4, 1};
  std::vector<float> lv = logits.to_vector<float>();
  for (double smoothing : {0.0, 0.1, 0.3}) {
    SCOPED_TRACE(smoothing);
    double want = 0;
    for (int64_t i = 0; i < 4; ++i) {
      double mx = *std::max_element(lv.begin() + i * 5, lv.begin() + i * 5 + 5), z = 0;
      for (int64_t j = 0; j < 5; ++j) z += std::exp(lv[i * 5 + j] - mx);
      double lse = mx + std::log(z), sum_logp = 0;
      for (int64_t j = 0; j < 5; ++j) sum_logp += lv[i * 5 + j] - lse;
      want += -(1 - smoothing) * (lv[i * 5 + t[i]] - lse) - smoothing / 5 * sum_logp;
    }
    want /= 4;
    Tensor loss = F::cross_entropy(logits, ints(t, {4}), smoothing);
    EXPECT_EQ(loss.dim(), 0);
    EXPECT_NEAR(loss.item(), want, 1e-5);
    // The same in float64 to double precision.
    EXPECT_NEAR(F::cross_entropy(logits.to(kFloat64), ints(t, {4}), smoothing).item(), want, 1e-12);
  }
  // int32 targets work too; the uniform prediction costs log(C).
  EXPECT_NEAR(F::cross_entropy(zeros({3, 7}), ints({0, 6, 3}, {3}).to(kInt32)).item(), std::log(7.0), 1e-6);
}

TEST(OpsNN, MseLossMatchesTheDefinition) {
  Tensor a = rnd({3, 4}, 21), b = rnd({3, 4}, 22);
  std::vector<float> av = a.to_vector<float>(), bv = b.to_vector<float>();
  double want = 0;
  for (size_t i = 0; i < av.size(); ++i) want += std::pow(static_cast<double>(av[i]) - bv[i], 2);
  EXPECT_NEAR(F::mse_loss(a, b).item(), want / 12, 1e-6);
  EXPECT_EQ(F::mse_loss(a, a).item(), 0.0);
}

TEST(OpsNN, DropoutKeepsAScaledFraction) {
  const double p = 0.3;
  Tensor x = rnd({200, 100}, 23, 0.5, 1.5);
  manual_seed(77);
  Tensor y = F::dropout(x, p, true);
  std::vector<float> xv = x.to_vector<float>(), yv = y.to_vector<float>();
  const float scale = static_cast<float>(1.0 / (1.0 - p));
  int64_t kept = 0;
  for (size_t i = 0; i < xv.size(); ++i) {
    if (yv[i] != 0) {
      ++kept;
      EXPECT_FLOAT_EQ(yv[i], xv[i] * scale);
    }
  }
  // 20000 Bernoulli(0.7) draws: standard deviation of the kept fraction ~0.0032.
  EXPECT_NEAR(static_cast<double>(kept) / xv.size(), 1 - p, 0.02);
  manual_seed(77);
  EXPECT_EQ(F::dropout(x, p, true).to_vector<float>(), yv);  // same seed, same mask
  EXPECT_NE(F::dropout(x, p, true).to_vector<float>(), yv);  // the stream moved on
  EXPECT_TRUE(F::dropout(x, p, false).is_same(x));  // eval: identity
  EXPECT_EQ(F::dropout(x, 0.0, true).to_vector<float>(), xv);
  nn::Dropout layer(0.5);
  layer.eval();
  EXPECT_EQ(layer.forward(x).to_vector<float>(), xv);
}

// ---- errors name the op and the shapes ------------------------------------------------------

TEST(OpsNN, ShapeErrorsNameTheOpAndTheShapes) {
  Tensor x = zeros({2, 3, 8, 8});
  EXPECT_TRUE(throws_naming([&] { F::conv2d(x, zeros({4, 2, 3, 3}), Tensor(), {}); }, {"conv2d", "[2, 3, 8, 8]", "[4, 2, 3, 3]"}));
  EXPECT_TRUE(throws_naming([&] { F::conv2d(zeros({3, 8, 8}), zeros({4, 3, 3, 3}), Tensor(), {}); }, {"conv2d", "[3, 8, 8]"}));
  EXPECT_TRUE(throws_naming([&] { F::conv2d(x, zeros({4, 3, 3, 3}), zeros({5}), {}); }, {"conv2d", "[5]"}));
  EXPECT_TRUE(throws_naming([&] { F::conv2d(x, zeros({4, 3, 9, 9}), Tensor(), {}); }, {"conv2d", "[2, 3, 8, 8]"}));
  EXPECT_TRUE(throws_naming([&] { F::conv2d(x, zeros({4, 1, 3, 3}), Tensor(), Conv2dParams{1, 1, 0, 0, 1, 1, 2}); },
                      {"conv2d", "groups"}));
  EXPECT_TRUE(throws_naming([&] { F::linear(zeros({2, 3}), zeros({4, 5}), Tensor()); }, {"linear", "[2, 3]", "[4, 5]"}));
  EXPECT_TRUE(throws_naming([&] { F::linear(zeros({2, 5}), zeros({4, 5}), zeros({3})); }, {"linear", "[3]"}));
  EXPECT_TRUE(throws_naming([&] { F::max_pool2d(zeros({3, 8, 8}), {2, 2, 2, 2}); }, {"max_pool2d", "[3, 8, 8]"}));
  EXPECT_TRUE(throws_naming([&] { F::avg_pool2d(zeros({3, 8}), {2, 2, 2, 2}); }, {"avg_pool2d", "[3, 8]"}));
  EXPECT_TRUE(throws_naming([&] { F::max_pool2d(x, {9, 9, 1, 1}); }, {"max_pool2d", "[2, 3, 8, 8]"}));
  EXPECT_TRUE(throws_naming([&] { F::adaptive_avg_pool2d(zeros({3, 8}), 1, 1); }, {"adaptive_avg_pool2d", "[3, 8]"}));
  EXPECT_TRUE(throws_naming([&] { F::batch_norm(x, zeros({3}), ones({3}), ones({4}), zeros({3}), true, 0.1, 1e-5); },
                      {"batch_norm", "[4]", "[2, 3, 8, 8]"}));
  EXPECT_TRUE(throws_naming([&] { F::batch_norm(zeros({2, 3, 4}), zeros({3}), ones({3}), Tensor(), Tensor(), true, 0.1, 1e-5); },
                      {"batch_norm", "[2, 3, 4]"}));
  EXPECT_TRUE(throws_naming([&] { F::batch_norm(zeros({1, 3}), Tensor(), Tensor(), Tensor(), Tensor(), true, 0.1, 1e-5); },
                      {"batch_norm", "[1, 3]"}));
  EXPECT_TRUE(throws_naming([&] { F::cross_entropy(zeros({4, 5}), ints({0, 1, 2}, {3})); }, {"cross_entropy", "[3]", "[4, 5]"}));
  EXPECT_TRUE(throws_naming([&] { F::cross_entropy(zeros({4}), ints({0, 1, 2, 3}, {4})); }, {"cross_entropy", "[4]"}));
  EXPECT_TRUE(throws_naming([&] { F::cross_entropy(zeros({2, 5}), ints({0, 5}, {2})); }, {"cross_entropy", "5"}));
  EXPECT_TRUE(throws_naming([&] { F::mse_loss(zeros({2, 3}), zeros({3, 2})); }, {"mse_loss", "[2, 3]", "[3, 2]"}));
  EXPECT_TRUE(throws_naming([&] { softmax(zeros({2, 3}), 2); }, {"softmax", "dim"}));
  EXPECT_TRUE(throws_naming([&] { log_softmax(zeros({2, 3}), -3); }, {"log_softmax", "dim"}));
  EXPECT_TRUE(throws_naming([&] { F::dropout(x, 1.0, true); }, {"dropout"}));
}

}  // namespace
}  // namespace chorus
