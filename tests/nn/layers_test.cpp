// Layers and init: BatchNorm2d's running statistics follow PyTorch's update
// rule (closed form, unbiased variance), layer forwards match the functional
// ops, init fans and Kaiming/Xavier statistics.
#include <gtest/gtest.h>

#include <chorus/chorus.h>

#include <cmath>

#include "testing/gradcheck.h"

namespace chorus::nn {
namespace {

using test::uniform_values;

Tensor rnd(const Shape& s, uint64_t seed, double lo = -1, double hi = 1) {
  return from_vector(uniform_values(numel_of(s), seed, lo, hi), s);
}

Tensor buffer(Module& m, const std::string& name) {
  for (auto& [n, t] : m.named_buffers())
    if (n == name) return t;
  throw std::runtime_error("no buffer " + name);
}

// Bounds are rounded to float before sampling: allow that rounding.
double slack(double bound) { return bound * (1 + 1e-6); }

struct Moments {
  double mean, var, min, max;
};
Moments moments(const Tensor& t) {
  std::vector<float> v = t.to_vector<float>();
  double s = 0, s2 = 0, lo = INFINITY, hi = -INFINITY;
  for (float x : v) {
    s += x;
    s2 += static_cast<double>(x) * x;
    lo = std::min<double>(lo, x);
    hi = std::max<double>(hi, x);
  }
  double m = s / v.size();
  return {m, s2 / v.size() - m * m, lo, hi};
}

// ---- BatchNorm2d ----------------------------------------------------------------------

TEST(NNBatchNorm2d, RunningStatisticsFollowPyTorchsRule) {
  const int64_t n = 3, c = 2, h = 2, w = 3, per = n * h * w;
  const double momentum = 0.3;
  BatchNorm2d bn(BatchNorm2dOptions{c, 1e-5, momentum});
  std::vector<double> rm(c, 0.0), rv(c, 1.0);  // the documented initial values
  for (int step = 0; step < 3; ++step) {
    Tensor x = rnd({n, c, h, w}, 100 + step, -1 + step, 2 + 2 * step);
    std::vector<float> xv = x.to_vector<float>();
    bn.forward(x);
    for (int64_t ch = 0; ch < c; ++ch) {
      double mean = 0, ss = 0;
      for (int64_t i = 0; i < n; ++i)
        for (int64_t k = 0; k < h * w; ++k) mean += xv[(i * c + ch) * h * w + k];
      mean /= per;
      for (int64_t i = 0; i < n; ++i)
        for (int64_t k = 0; k < h * w; ++k) ss += std::pow(xv[(i * c + ch) * h * w + k] - mean, 2);
      rm[ch] = (1 - momentum) * rm[ch] + momentum * mean;
      rv[ch] = (1 - momentum) * rv[ch] + momentum * ss / (per - 1);  // unbiased
    }
    std::vector<float> got_m = buffer(bn, "running_mean").to_vector<float>();
    std::vector<float> got_v = buffer(bn, "running_var").to_vector<float>();
    for (int64_t ch = 0; ch < c; ++ch) {
      EXPECT_NEAR(got_m[ch], rm[ch], 1e-5) << "step " << step << " channel " << ch;
      EXPECT_NEAR(got_v[ch], rv[ch], 1e-5 * std::max(1.0, rv[ch])) << "step " << step << " channel " << ch;
    }
    EXPECT_EQ(buffer(bn, "num_batches_tracked").item(), step + 1);
  }
  // Evaluation normalises with the running statistics and leaves them alone.
  bn.eval();
  Tensor x = rnd({n, c, h, w}, 200);
  std::vector<float> xv = x.to_vector<float>(), y = bn.forward(x).to_vector<float>();
  for (int64_t i = 0; i < x.numel(); ++i) {
    int64_t ch = (i / (h * w)) % c;
    EXPECT_NEAR(y[i], (xv[i] - rm[ch]) / std::sqrt(rv[ch] + 1e-5), 1e-5);  // weight 1, bias 0 at init
  }
  EXPECT_NEAR(buffer(bn, "running_mean").to_vector<float>()[0], rm[0], 1e-5);
  EXPECT_EQ(buffer(bn, "num_batches_tracked").item(), 3);
}

TEST(NNBatchNorm2d, TrainingOutputIsNormalisedPerChannel) {
  BatchNorm2d bn(4);
  Tensor x = rnd({8, 4, 3, 3}, 7, 2, 5);
  Tensor y = bn.forward(x);
  std::vector<float> m = y.mean({0, 2, 3}).to_vector<float>();
  Tensor centered = y - y.mean({0, 2, 3}, true);
  std::vector<float> v = (centered * centered).mean({0, 2, 3}).to_vector<float>();
  for (int c = 0; c < 4; ++c) {
    EXPECT_NEAR(m[c], 0.0, 1e-5);
    EXPECT_NEAR(v[c], 1.0, 1e-3);  // biased variance / (var + eps)
  }
  BatchNorm2d plain(BatchNorm2dOptions{4, 1e-5, 0.1, false});
  EXPECT_TRUE(plain.named_parameters().empty());
  EXPECT_EQ(plain.forward(x).sizes(), x.sizes());
  EXPECT_THROW(bn.forward(rnd({8, 3, 3, 3}, 8)), ValueError);
}

// ---- layers agree with the functional ops --------------------------------------------------

TEST(NNLayers, ForwardsMatchTheFunctionalOps) {
  Linear lin(5, 3);
  Tensor x = rnd({4, 5}, 1);
  EXPECT_EQ(lin.forward(x).to_vector<float>(), functional::linear(x, lin.weight(), lin.bias()).to_vector<float>());
  Linear nob(5, 3, false);
  EXPECT_FALSE(nob.bias().defined());
  EXPECT_EQ(nob.named_parameters().size(), 1u);
  Conv2d conv(Conv2dOptions{2, 4, 3, 2, 1, 1, 2});
  EXPECT_EQ(conv.weight().sizes(), (Shape{4, 1, 3, 3}));
  Tensor img = rnd({2, 2, 7, 7}, 2);
  EXPECT_EQ(conv.forward(img).to_vector<float>(),
            functional::conv2d(img, conv.weight(), conv.bias(), {2, 2, 1, 1, 1, 1, 2}).to_vector<float>());
  ReLU relu;
  EXPECT_EQ(relu.forward(x).to_vector<float>(), x.relu().to_vector<float>());
  Flatten flat;
  EXPECT_EQ(flat.forward(img).sizes(), (Shape{2, 98}));
  AdaptiveAvgPool2d gap;
  EXPECT_EQ(gap.forward(img).sizes(), (Shape{2, 2, 1, 1}));
  AdaptiveAvgPool2d ap2(AdaptiveOptions{3, 2});
  EXPECT_EQ(ap2.forward(img).sizes(), (Shape{2, 2, 3, 2}));
  EXPECT_THROW(Linear(0, 3), ValueError);
  EXPECT_THROW(Conv2d(Conv2dOptions{3, 4, 3, 1, 0, 1, 2}), ValueError);  // groups do not divide 3
  EXPECT_THROW(Dropout(1.0), ValueError);
}

// ---- init ------------------------------------------------------------------------------------

TEST(NNInit, Fans) {
  EXPECT_EQ(init::fans(empty({8, 5})), std::make_pair(int64_t{5}, int64_t{8}));
  EXPECT_EQ(init::fans(empty({8, 4, 3, 3})), std::make_pair(int64_t{36}, int64_t{72}));
  EXPECT_EQ(init::fans(empty({6, 2, 5, 1})), std::make_pair(int64_t{10}, int64_t{30}));
  EXPECT_THROW(init::fans(empty({8})), ValueError);
}

TEST(NNInit, KaimingNormalStd) {
  manual_seed(1);
  Tensor w = empty({256, 64, 3, 3});  // fan_in 576, fan_out 2304, 147456 samples
  init::kaiming_normal_(w);
  Moments m = moments(w);
  const double std_in = std::sqrt(2.0 / 576);
  // The sample std has relative standard error 1/sqrt(2n) ~ 0.2%; allow 1%.
  EXPECT_NEAR(std::sqrt(m.var), std_in, 0.01 * std_in);
  EXPECT_NEAR(m.mean, 0.0, 5 * std_in / std::sqrt(147456.0));
  init::kaiming_normal_(w, /*fan_out=*/true);
  EXPECT_NEAR(std::sqrt(moments(w).var), std::sqrt(2.0 / 2304), 0.01 * std::sqrt(2.0 / 2304));
  EXPECT_FALSE(w.requires_grad());
}

TEST(NNInit, KaimingAndXavierUniformBounds) {
  manual_seed(2);
  Tensor w = empty({512, 300});  // fan_in 300, fan_out 512
  for (double a : {0.0, std::sqrt(5.0)}) {
    init::kaiming_uniform_(w, a);
    const double bound = std::sqrt(2.0 / (1 + a * a)) * std::sqrt(3.0 / 300);
    Moments m = moments(w);
    EXPECT_GE(m.min, -slack(bound));
    EXPECT_LE(m.max, slack(bound));
    EXPECT_GT(m.max, 0.99 * bound);  // the range is used
    EXPECT_NEAR(m.var, bound * bound / 3, 0.02 * bound * bound / 3);
  }
  init::xavier_uniform_(w, 2.0);
  const double xb = 2.0 * std::sqrt(6.0 / 812);
  Moments xm = moments(w);
  EXPECT_LE(xm.max, slack(xb));
  EXPECT_GE(xm.min, -slack(xb));
  EXPECT_NEAR(xm.var, xb * xb / 3, 0.02 * xb * xb / 3);
  init::xavier_normal_(w);
  EXPECT_NEAR(std::sqrt(moments(w).var), std::sqrt(2.0 / 812), 0.01 * std::sqrt(2.0 / 812));
  init::constant_(w, 0.25);
  EXPECT_EQ(moments(w).min, 0.25);
  EXPECT_EQ(moments(w).max, 0.25);
  init::normal_(w, 3.0, 0.5);
  EXPECT_NEAR(moments(w).mean, 3.0, 0.01);
  init::uniform_(w, -2.0, -1.0);
  EXPECT_GE(moments(w).min, -slack(2.0));
  EXPECT_LE(moments(w).max, -1.0 + 1e-6);
}

TEST(NNInit, InitOnAParameterRecordsNoGraph) {
  Linear lin(300, 200);
  init::kaiming_normal_(lin.weight());
  EXPECT_TRUE(lin.weight().is_leaf());
  EXPECT_TRUE(lin.weight().requires_grad());
  EXPECT_NEAR(std::sqrt(moments(lin.weight()).var), std::sqrt(2.0 / 300), 0.03 * std::sqrt(2.0 / 300));
}

TEST(NNInit, DefaultLayerInitIsPyTorchs) {
  // kaiming_uniform(a = sqrt(5)) gives bound 1/sqrt(fan_in) for the weight; the bias uses the same bound.
  manual_seed(3);
  Linear lin(400, 300);
  const double lb = 1.0 / std::sqrt(400.0);
  Moments w = moments(lin.weight()), b = moments(lin.bias());
  EXPECT_LE(w.max, slack(lb));
  EXPECT_GE(w.min, -slack(lb));
  EXPECT_NEAR(w.var, lb * lb / 3, 0.03 * lb * lb / 3);
  EXPECT_LE(b.max, slack(lb));
  EXPECT_GE(b.min, -slack(lb));
  Conv2d conv(Conv2dOptions{16, 32, 3});
  const double cb = 1.0 / std::sqrt(16.0 * 9);
  Moments cw = moments(conv.weight());
  EXPECT_LE(cw.max, slack(cb));
  EXPECT_GE(cw.min, -slack(cb));
  EXPECT_NEAR(cw.var, cb * cb / 3, 0.05 * cb * cb / 3);
  Moments cbias = moments(conv.bias());
  EXPECT_LE(cbias.max, slack(cb));
  EXPECT_GE(cbias.min, -slack(cb));
  BatchNorm2d bn(5);
  EXPECT_EQ(moments(bn.named_parameters()[0].second).min, 1.0);  // weight ones
  EXPECT_EQ(moments(bn.named_parameters()[1].second).max, 0.0);  // bias zeros
}

}  // namespace
}  // namespace chorus::nn
