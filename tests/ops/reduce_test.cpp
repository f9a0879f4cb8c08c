// Reductions against std::accumulate / naive loops: sum, mean, max, argmax
// over any set of dims, keepdim, non-contiguous inputs, integer dtypes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include <chorus/chorus.h>

#include "testing/expect_error.h"
#include "testing/gradcheck.h"

namespace chorus {
namespace {

using test::uniform_values;

// Naive reduction of a row-major [A, B, C] array over the dims in `red`.
std::vector<double> naive_reduce(const std::vector<float>& x, const Shape& s, const std::vector<bool>& red,
                                 bool mean, bool max) {
  Shape out_s = s;
  for (size_t d = 0; d < s.size(); ++d)
    if (red[d]) out_s[d] = 1;
  int64_t n_out = numel_of(out_s);
  std::vector<double> acc(n_out, max ? -INFINITY : 0.0), cnt(n_out, 0.0);
  for (int64_t i = 0; i < numel_of(s); ++i) {
    int64_t rem = i, o = 0, stride = 1;
    for (int64_t d = static_cast<int64_t>(s.size()) - 1; d >= 0; --d) {
      int64_t c = rem % s[d];
      rem /= s[d];
      if (!red[d]) o += c * stride;
      stride *= out_s[d];
    }
    if (max) acc[o] = std::max(acc[o], static_cast<double>(x[i]));
    else acc[o] += x[i];
    cnt[o] += 1;
  }
  if (mean)
    for (int64_t o = 0; o < n_out; ++o) acc[o] /= cnt[o];
  return acc;
}

TEST(OpsReduce, SumAllMatchesAccumulate) {
  std::vector<double> v = uniform_values(1000, 1);
  Tensor x = from_vector(v, {10, 100});
  std::vector<float> xv = x.to_vector<float>();
  double want = std::accumulate(xv.begin(), xv.end(), 0.0);
  Tensor s = x.sum();
  EXPECT_EQ(s.dim(), 0);
  EXPECT_EQ(s.dtype(), kFloat32);
  EXPECT_NEAR(s.item(), want, 1e-4);
  EXPECT_NEAR(x.mean().item(), want / 1000, 1e-7);
}

TEST(OpsReduce, OverSeveralDimsWithAndWithoutKeepdim) {
  const Shape s{3, 4, 5};
  std::vector<double> v = uniform_values(60, 2);
  Tensor x = from_vector(v, s);
  std::vector<float> xv = x.to_vector<float>();
  struct Case {
    Shape dims;
    std::vector<bool> red;
    Shape out, out_keep;
  };
  for (const Case& c : std::vector<Case>{{{0}, {1, 0, 0}, {4, 5}, {1, 4, 5}},
                                         {{1}, {0, 1, 0}, {3, 5}, {3, 1, 5}},
                                         {{-1}, {0, 0, 1}, {3, 4}, {3, 4, 1}},
                                         {{0, 2}, {1, 0, 1}, {4}, {1, 4, 1}},
                                         {{2, 0}, {1, 0, 1}, {4}, {1, 4, 1}},
                                         {{0, 1, 2}, {1, 1, 1}, {}, {1, 1, 1}}}) {
    SCOPED_TRACE(shape_str(c.dims));
    for (bool keep : {false, true}) {
      Tensor sm = x.sum(c.dims, keep), mn = x.mean(c.dims, keep);
      EXPECT_EQ(sm.sizes(), keep ? c.out_keep : c.out);
      EXPECT_EQ(mn.sizes(), keep ? c.out_keep : c.out);
      std::vector<double> ws = naive_reduce(xv, s, c.red, false, false);
      std::vector<double> wm = naive_reduce(xv, s, c.red, true, false);
      std::vector<float> gs = sm.to_vector<float>(), gm = mn.to_vector<float>();
      ASSERT_EQ(gs.size(), ws.size());
      for (size_t i = 0; i < ws.size(); ++i) {
        EXPECT_NEAR(gs[i], ws[i], 1e-5);
        EXPECT_NEAR(gm[i], wm[i], 1e-6);
      }
    }
  }
}

TEST(OpsReduce, NonContiguousInputs) {
  std::vector<double> v = uniform_values(60, 3);
  Tensor base = from_vector(v, {3, 4, 5});
  Tensor p = base.permute({2, 0, 1});  // [5, 3, 4]
  std::vector<float> pv = p.contiguous().to_vector<float>();
  std::vector<double> want = naive_reduce(pv, {5, 3, 4}, {0, 1, 0}, false, false);
  std::vector<float> got = p.sum({1}).to_vector<float>();
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5);
  Tensor stepped = base.slice(2, 0, 5, 2);  // [3, 4, 3]
  std::vector<float> sv = stepped.contiguous().to_vector<float>();
  std::vector<double> w2 = naive_reduce(sv, {3, 4, 3}, {1, 0, 1}, true, false);
  std::vector<float> g2 = stepped.mean({0, 2}).to_vector<float>();
  for (size_t i = 0; i < w2.size(); ++i) EXPECT_NEAR(g2[i], w2[i], 1e-6);
  // An expanded (stride 0) dim counts every repeat.
  Tensor e = from_vector(std::vector<float>{1, 2, 3}, {3, 1}).expand({3, 4});
  EXPECT_EQ(e.sum({1}).to_vector<float>(), (std::vector<float>{4, 8, 12}));
  EXPECT_EQ(e.sum().item(), 24);
}

TEST(OpsReduce, MaxAndArgmax) {
  const Shape s{3, 4, 5};
  std::vector<double> v = uniform_values(60, 4);
  Tensor x = from_vector(v, s);
  std::vector<float> xv = x.to_vector<float>();
  for (int64_t d = 0; d < 3; ++d) {
    SCOPED_TRACE(d);
    std::vector<bool> red(3, false);
    red[d] = true;
    std::vector<double> want = naive_reduce(xv, s, red, false, true);
    Tensor m = x.max(d), mk = x.max(d, true);
    Tensor am = x.argmax(d), amk = x.argmax(d, true);
    Shape out = s;
    out.erase(out.begin() + d);
    Shape keep = s;
    keep[d] = 1;
    EXPECT_EQ(m.sizes(), out);
    EXPECT_EQ(mk.sizes(), keep);
    EXPECT_EQ(am.sizes(), out);
    EXPECT_EQ(amk.sizes(), keep);
    EXPECT_EQ(am.dtype(), kInt64);
    std::vector<float> mv = m.to_vector<float>();
    std::vector<int64_t> av = am.to_vector<int64_t>();
    std::vector<float> at_argmax = gather(x, d, amk).to_vector<float>();  // the argmax points at the max
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(mv[i], want[i]);
      EXPECT_EQ(at_argmax[i], want[i]);
      EXPECT_GE(av[i], 0);
      EXPECT_LT(av[i], s[d]);
    }
  }
  double global = *std::max_element(xv.begin(), xv.end());
  EXPECT_EQ(x.max().item(), global);
  EXPECT_EQ(x.max().dim(), 0);
}

TEST(OpsReduce, ArgmaxTakesTheFirstOfTies) {
  Tensor t = from_vector(std::vector<float>{1, 5, 5, 2, 7, 7, 7, 0}, {2, 4});
  EXPECT_EQ(t.argmax(1).to_vector<int64_t>(), (std::vector<int64_t>{1, 0}));
  EXPECT_EQ(argmax(t, 1).to_vector<int64_t>(), (std::vector<int64_t>{1, 0}));
  EXPECT_EQ(t.argmax(0).to_vector<int64_t>(), (std::vector<int64_t>{1, 1, 1, 0}));
  // NaN wins, as in PyTorch.
  Tensor n = from_vector(std::vector<float>{1, NAN, 3}, {3});
  EXPECT_EQ(n.argmax(0).item(), 1);
  EXPECT_TRUE(std::isnan(n.max().item()));
}

TEST(OpsReduce, IntegerDtypes) {
  Tensor i = from_vector(std::vector<int64_t>{3, -1, 4, 1, -5, 9}, {2, 3});
  Tensor s = i.sum();
  EXPECT_EQ(s.dtype(), kInt64);
  EXPECT_EQ(s.item(), 11);
  EXPECT_EQ(i.sum({1}).to_vector<int64_t>(), (std::vector<int64_t>{6, 5}));
  EXPECT_EQ(i.to(kInt32).sum({0}).to_vector<int64_t>(), (std::vector<int64_t>{4, -6, 13}));
  Tensor m = i.mean({1});
  EXPECT_EQ(m.dtype(), kFloat32);  // the mean of integers is fractional
  EXPECT_EQ(m.to_vector<float>(), (std::vector<float>{2.0f, 5.0f / 3.0f}));
  EXPECT_EQ(i.max(1).to_vector<int64_t>(), (std::vector<int64_t>{4, 9}));
  EXPECT_EQ(i.argmax(1).to_vector<int64_t>(), (std::vector<int64_t>{2, 2}));
  Tensor b = from_vector(std::vector<float>{1, 0, 1, 1}, {4}).to(kBool);
  EXPECT_EQ(b.sum().item(), 3);
}

TEST(OpsReduce, Float64AccumulatesInDouble) {
  // 1000 * 1e-13, then 1: float would return exactly 1.
  std::vector<double> v(1001, 1e-13);
  v[1000] = 1.0;
  Tensor x = from_vector(v, {1001}, {kFloat64});
  EXPECT_NEAR(x.sum().item(), 1.0 + 1000 * 1e-13, 1e-14);
  EXPECT_NE(x.sum().item(), 1.0);
  EXPECT_EQ(x.sum().dtype(), kFloat64);
}

TEST(OpsReduce, ErrorsNameTheOp) {
  Tensor x = zeros({2, 3});
  EXPECT_TRUE(test::throws_naming([&] { x.sum({2}); }, {"sum", "out of range"}));
  EXPECT_TRUE(test::throws_naming([&] { x.mean({-3}); }, {"mean", "out of range"}));
  EXPECT_TRUE(test::throws_naming([&] { x.max(5); }, {"max", "out of range"}));
  EXPECT_TRUE(test::throws_naming([&] { x.argmax(2); }, {"argmax", "out of range"}));
}

}  // namespace
}  // namespace chorus
