// Elementwise ops against naive references computed here on the host:
// unary math, binary ops with broadcasting, comparisons, type promotion,
// integer dtypes, in-place ops, and shape errors that name the op.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>

#include <chorus/chorus.h>

#include "testing/expect_error.h"
#include "testing/gradcheck.h"

namespace chorus {
namespace {

using test::throws_naming;

using test::uniform_values;

Tensor f32(const std::vector<double>& v, const Shape& s) { return from_vector(v, s); }

// Index of element `i` of a row-major `out` shape in a row-major `in` shape
// that broadcasts to it (NumPy rules, written out).
int64_t broadcast_index(int64_t i, const Shape& out, const Shape& in) {
  int64_t idx = 0, stride = 1;
  for (int64_t d = static_cast<int64_t>(out.size()) - 1, e = static_cast<int64_t>(in.size()) - 1; d >= 0; --d, --e) {
    int64_t coord = i % out[d];
    i /= out[d];
    if (e >= 0) {
      if (in[e] != 1) idx += coord * stride;
      stride *= in[e];
    }
  }
  return idx;
}

void expect_binary(const std::function<Tensor(const Tensor&, const Tensor&)>& op,
                   const std::function<double(double, double)>& ref, const Shape& sa, const Shape& sb,
                   const Shape& sout, double lo = -2, double hi = 2, double tol = 1e-6) {
  std::vector<double> va = uniform_values(numel_of(sa), 1, lo, hi), vb = uniform_values(numel_of(sb), 2, lo, hi);
  Tensor a = f32(va, sa), b = f32(vb, sb);
  Tensor out = op(a, b);
  ASSERT_EQ(out.sizes(), sout);
  std::vector<float> got = out.to_vector<float>();
  std::vector<float> fa = a.to_vector<float>(), fb = b.to_vector<float>();
  for (int64_t i = 0; i < numel_of(sout); ++i) {
    double want = ref(fa[broadcast_index(i, sout, sa)], fb[broadcast_index(i, sout, sb)]);
    EXPECT_NEAR(got[i], want, tol * std::max(1.0, std::abs(want))) << "element " << i;
  }
}

TEST(OpsElementwise, UnaryMatchesStd) {
  std::vector<double> v = uniform_values(50, 3, -3, 3);
  Tensor x = f32(v, {5, 10});
  std::vector<float> xv = x.to_vector<float>();
  struct Case {
    const char* name;
    std::function<Tensor(const Tensor&)> op;
    std::function<double(double)> ref;
    bool positive;
  };
  std::vector<Case> cases = {
      {"exp", [](const Tensor& t) { return t.exp(); }, [](double a) { return std::exp(a); }, false},
      {"log", [](const Tensor& t) { return t.log(); }, [](double a) { return std::log(a); }, true},
      {"sqrt", [](const Tensor& t) { return t.sqrt(); }, [](double a) { return std::sqrt(a); }, true},
      {"tanh", [](const Tensor& t) { return t.tanh(); }, [](double a) { return std::tanh(a); }, false},
      {"sigmoid", [](const Tensor& t) { return t.sigmoid(); }, [](double a) { return 1 / (1 + std::exp(-a)); }, false},
      {"relu", [](const Tensor& t) { return t.relu(); }, [](double a) { return a > 0 ? a : 0; }, false},
      {"abs", [](const Tensor& t) { return t.abs(); }, [](double a) { return std::abs(a); }, false},
      {"neg", [](const Tensor& t) { return t.neg(); }, [](double a) { return -a; }, false},
      {"pow", [](const Tensor& t) { return t.pow(1.7); }, [](double a) { return std::pow(a, 1.7); }, true},
      {"pow2", [](const Tensor& t) { return t.pow(2.0); }, [](double a) { return a * a; }, false},
      {"add_s", [](const Tensor& t) { return t + 2.5; }, [](double a) { return a + 2.5; }, false},
      {"sub_s", [](const Tensor& t) { return t - 2.5; }, [](double a) { return a - 2.5; }, false},
      {"mul_s", [](const Tensor& t) { return t * -3.0; }, [](double a) { return a * -3.0; }, false},
      {"div_s", [](const Tensor& t) { return t / 4.0; }, [](double a) { return a / 4.0; }, false},
      {"rsub_s", [](const Tensor& t) { return 1.0 - t; }, [](double a) { return 1.0 - a; }, false},
  };
  Tensor xp = x.abs().add(0.1);
  std::vector<float> xpv = xp.to_vector<float>();
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const Tensor& in = c.positive ? xp : x;
    const std::vector<float>& iv = c.positive ? xpv : xv;
    Tensor out = c.op(in);
    EXPECT_EQ(out.dtype(), kFloat32);
    EXPECT_EQ(out.sizes(), (Shape{5, 10}));
    std::vector<float> got = out.to_vector<float>();
    for (size_t i = 0; i < got.size(); ++i) {
      double want = c.ref(iv[i]);
      EXPECT_NEAR(got[i], want, 2e-6 * std::max(1.0, std::abs(want))) << "element " << i << " of " << iv[i];
    }
  }
}

TEST(OpsElementwise, UnaryInFloat64MatchesDoubleMath) {
  Tensor x = test::leaf(uniform_values(20, 4, 0.1, 3.0), {20}, cpu_device(0), false);
  std::vector<double> xv = x.to_vector<double>();
  std::vector<double> e = x.exp().to_vector<double>(), l = x.log().to_vector<double>(),
                      s = x.sqrt().to_vector<double>(), t = x.tanh().to_vector<double>();
  for (size_t i = 0; i < xv.size(); ++i) {
    EXPECT_DOUBLE_EQ(e[i], std::exp(xv[i]));
    EXPECT_DOUBLE_EQ(l[i], std::log(xv[i]));
    EXPECT_DOUBLE_EQ(s[i], std::sqrt(xv[i]));
    EXPECT_DOUBLE_EQ(t[i], std::tanh(xv[i]));
  }
}

TEST(OpsElementwise, BinaryWithBroadcasting) {
  auto add = [](const Tensor& a, const Tensor& b) { return a + b; };
  auto sub = [](const Tensor& a, const Tensor& b) { return a - b; };
  auto mul = [](const Tensor& a, const Tensor& b) { return a * b; };
  auto maxop = [](const Tensor& a, const Tensor& b) { return maximum(a, b); };
  auto addalpha = [](const Tensor& a, const Tensor& b) { return a.add(b, -0.5); };
  for (auto [sa, sb, so] : std::vector<std::tuple<Shape, Shape, Shape>>{
           {{3, 1, 4}, {5, 4}, {3, 5, 4}}, {{2, 3}, {2, 3}, {2, 3}}, {{}, {2, 3}, {2, 3}},
           {{4, 1}, {1, 6}, {4, 6}}, {{2, 1, 3}, {1}, {2, 1, 3}}}) {
    SCOPED_TRACE(shape_str(sa) + " with " + shape_str(sb));
    expect_binary(add, [](double a, double b) { return a + b; }, sa, sb, so);
    expect_binary(sub, [](double a, double b) { return a - b; }, sa, sb, so);
    expect_binary(mul, [](double a, double b) { return a * b; }, sa, sb, so);
    expect_binary(maxop, [](double a, double b) { return std::max(a, b); }, sa, sb, so);
    expect_binary(addalpha, [](double a, double b) { return a - 0.5 * b; }, sa, sb, so);
    expect_binary(mul, [](double a, double b) { return a * b; }, sb, sa, so);
  }
  auto div = [](const Tensor& a, const Tensor& b) { return a / b; };
  expect_binary(div, [](double a, double b) { return a / b; }, {3, 1, 4}, {5, 4}, {3, 5, 4}, 0.5, 2);
}

TEST(OpsElementwise, NonContiguousOperands) {
  std::vector<double> v = uniform_values(24, 5);
  Tensor base = f32(v, {4, 6});
  std::vector<float> bv = base.to_vector<float>();
  // base.t() (6 x 4) times base[:, ::2] transposed (3 x 4)... keep shapes simple:
  Tensor a = base.t().narrow(0, 0, 3);      // [3, 4]: a[i][j] = base[j][i]
  Tensor b = base.slice(1, 0, 6, 2).t();    // [3, 4]: b[i][j] = base[j][2i]
  std::vector<float> got = (a * b + a).to_vector<float>();
  for (int64_t i = 0; i < 3; ++i)
    for (int64_t j = 0; j < 4; ++j) {
      double x = bv[j * 6 + i], y = bv[j * 6 + 2 * i];
      EXPECT_NEAR(got[i * 4 + j], x * y + x, 1e-6);
    }
}

TEST(OpsElementwise, Comparisons) {
  Tensor a = f32({1, 2, 3, 4}, {4}), b = f32({2, 2, 2, 2}, {4});
  EXPECT_EQ(a.eq(b).dtype(), kBool);
  EXPECT_EQ(a.eq(b).to_vector<uint8_t>(), (std::vector<uint8_t>{0, 1, 0, 0}));
  EXPECT_EQ(a.ne(b).to_vector<uint8_t>(), (std::vector<uint8_t>{1, 0, 1, 1}));
  EXPECT_EQ(a.lt(b).to_vector<uint8_t>(), (std::vector<uint8_t>{1, 0, 0, 0}));
  EXPECT_EQ(a.le(b).to_vector<uint8_t>(), (std::vector<uint8_t>{1, 1, 0, 0}));
  EXPECT_EQ(a.gt(b).to_vector<uint8_t>(), (std::vector<uint8_t>{0, 0, 1, 1}));
  EXPECT_EQ(a.ge(b).to_vector<uint8_t>(), (std::vector<uint8_t>{0, 1, 1, 1}));
  // Broadcast against a column.
  Tensor col = f32({1, 3}, {2, 1});
  EXPECT_EQ(a.gt(col).sizes(), (Shape{2, 4}));
  EXPECT_EQ(a.gt(col).to_vector<uint8_t>(), (std::vector<uint8_t>{0, 1, 1, 1, 0, 0, 0, 1}));
  // Integers compare exactly.
  Tensor i = from_vector(std::vector<int64_t>{5, -7, 9}, {3}), j = from_vector(std::vector<int64_t>{5, 7, 8}, {3});
  EXPECT_EQ(i.eq(j).to_vector<uint8_t>(), (std::vector<uint8_t>{1, 0, 0}));
  EXPECT_EQ(i.lt(j).to_vector<uint8_t>(), (std::vector<uint8_t>{0, 1, 0}));
}

TEST(OpsElementwise, IntegerArithmeticAndPromotion) {
  Tensor i = from_vector(std::vector<int64_t>{5, -7, 9, 1000000}, {4});
  Tensor j = from_vector(std::vector<int64_t>{3, 2, -4, 1000000}, {4});
  Tensor s = i + j;
  EXPECT_EQ(s.dtype(), kInt64);
  EXPECT_EQ(s.to_vector<int64_t>(), (std::vector<int64_t>{8, -5, 5, 2000000}));
  EXPECT_EQ((i * j).to_vector<int64_t>(), (std::vector<int64_t>{15, -14, -36, 1000000000000}));
  EXPECT_EQ((i - j).to_vector<int64_t>(), (std::vector<int64_t>{2, -9, 13, 0}));
  EXPECT_EQ(maximum(i, j).to_vector<int64_t>(), (std::vector<int64_t>{5, 2, 9, 1000000}));
  Tensor i32 = i.to(kInt32);
  EXPECT_EQ((i32 + i32).dtype(), kInt32);
  EXPECT_EQ((i32 + i32).to_vector<int32_t>(), (std::vector<int32_t>{10, -14, 18, 2000000}));
  // int32 with int64 -> int64; int with float -> float; bf16 with float32 -> float32.
  EXPECT_EQ((i32 + j).dtype(), kInt64);
  Tensor f = f32({0.5, 0.5, 0.5, 0.5}, {4});
  EXPECT_EQ((i + f).dtype(), kFloat32);
  EXPECT_EQ((f + i).to_vector<float>(), (std::vector<float>{5.5f, -6.5f, 9.5f, 1000000.5f}));
  EXPECT_EQ((f.to(kBFloat16) + f).dtype(), kFloat32);
  EXPECT_EQ((f.to(kBFloat16) + f.to(kFloat16)).dtype(), kFloat32);
  EXPECT_EQ((f.to(kFloat64) + f).dtype(), kFloat64);
  EXPECT_EQ((f.to(kBFloat16) * f.to(kBFloat16)).dtype(), kBFloat16);
  // Transcendental ops on integers compute in float32.
  Tensor e = from_vector(std::vector<int64_t>{0, 1, 4}, {3}).sqrt();
  EXPECT_EQ(e.dtype(), kFloat32);
  EXPECT_EQ(e.to_vector<float>(), (std::vector<float>{0, 1, 2}));
  // uint8 adds stay uint8.
  Tensor u = from_vector(std::vector<int64_t>{1, 2, 250}, {3}).to(kUInt8);
  EXPECT_EQ((u + u).dtype(), kUInt8);
  EXPECT_EQ((u + u).to_vector<uint8_t>()[1], 4);
}

TEST(OpsElementwise, ReducedPrecisionComputesInFloat) {
  std::vector<double> v = uniform_values(64, 6);
  Tensor a = f32(v, {64}), b = f32(uniform_values(64, 7), {64});
  for (DType dt : {kBFloat16, kFloat16}) {
    SCOPED_TRACE(dtype_name(dt));
    Tensor ar = a.to(dt), br = b.to(dt);
    std::vector<float> got = (ar * br).to_vector<float>();
    std::vector<float> fa = ar.to_vector<float>(), fb = br.to_vector<float>();
    for (size_t i = 0; i < got.size(); ++i) {
      // The product of the rounded inputs, rounded once to the dtype.
      float want = dt == kBFloat16 ? static_cast<float>(BFloat16(fa[i] * fb[i]))
                                   : static_cast<float>(Float16(fa[i] * fb[i]));
      EXPECT_EQ(got[i], want) << i;
    }
  }
}

TEST(OpsElementwise, InPlaceOps) {
  Tensor a = f32({1, 2, 3, 4, 5, 6}, {2, 3});
  a.add_(f32({10, 20, 30}, {3}));
  EXPECT_EQ(a.to_vector<float>(), (std::vector<float>{11, 22, 33, 14, 25, 36}));
  a.add_(f32({1, 1}, {2, 1}), -2.0);
  EXPECT_EQ(a.to_vector<float>(), (std::vector<float>{9, 20, 31, 12, 23, 34}));
  a.mul_(0.5);
  EXPECT_EQ(a.to_vector<float>(), (std::vector<float>{4.5f, 10, 15.5f, 6, 11.5f, 17}));
  a.mul_(f32({2, 0, 1}, {3}));
  EXPECT_EQ(a.to_vector<float>(), (std::vector<float>{9, 0, 15.5f, 12, 0, 17}));
  // In place on a view changes the base; the other operand may live on another device.
  Tensor on1 = f32({100, 100, 100}, {3}).to(Device("cpu:1"));
  a.select(0, 1).add_(on1);
  EXPECT_EQ(a.to_vector<float>(), (std::vector<float>{9, 0, 15.5f, 112, 100, 117}));
  EXPECT_EQ(a.device(), cpu_device(0));
  // The in-place result keeps self's dtype.
  Tensor i = from_vector(std::vector<int64_t>{1, 2}, {2});
  i.add_(f32({0.75, 0.75}, {2}));
  EXPECT_EQ(i.dtype(), kInt64);
}

TEST(OpsElementwise, ShapeErrorsNameTheOpAndTheShapes) {
  Tensor a = zeros({2, 3}), b = zeros({4});
  EXPECT_TRUE(throws_naming([&] { add(a, b); }, {"add", "[2, 3]", "[4]"}));
  EXPECT_TRUE(throws_naming([&] { sub(a, b); }, {"sub", "[2, 3]", "[4]"}));
  EXPECT_TRUE(throws_naming([&] { mul(a, b); }, {"mul", "[2, 3]", "[4]"}));
  EXPECT_TRUE(throws_naming([&] { div(a, b); }, {"div", "[2, 3]", "[4]"}));
  EXPECT_TRUE(throws_naming([&] { maximum(a, b); }, {"maximum", "[2, 3]", "[4]"}));
  EXPECT_TRUE(throws_naming([&] { a.eq(b); }, {"eq", "[2, 3]", "[4]"}));
  EXPECT_TRUE(throws_naming([&] { a.lt(b); }, {"lt", "[2, 3]", "[4]"}));
  EXPECT_TRUE(throws_naming([&] { a.add_(b); }, {"add_", "[4]", "[2, 3]"}));
  EXPECT_TRUE(throws_naming([&] { a.mul_(zeros({3, 3})); }, {"mul_", "[3, 3]", "[2, 3]"}));
  // In place cannot grow self.
  EXPECT_TRUE(throws_naming([&] { zeros({3}).add_(zeros({2, 3})); }, {"add_", "[2, 3]", "[3]"}));
}

}  // namespace
}  // namespace chorus
