// Autograd semantics: accumulation across backward calls, NoGradGuard, freed
// graphs and retain_graph, post-accumulate hooks, and graphs whose leaves live
// on different logical CPU devices.
#include <gtest/gtest.h>

#include <chorus/chorus.h>

#include "testing/expect_error.h"
#include "testing/gradcheck.h"

namespace chorus {
namespace {

using test::leaf;
using test::random_leaf;

std::vector<double> values(const Tensor& t) { return t.to_vector<double>(); }

TEST(AutogradEngine, GradientsAccumulateAcrossBackwardCalls) {
  Tensor x = leaf({1.0, -2.0, 3.0}, {3});
  Tensor w = leaf({0.5, 0.25, -1.0}, {3});
  mul(x, w).sum().backward();  // d/dx = w
  EXPECT_EQ(values(x.grad()), values(w.detach()));
  mul(mul(x, x), w).sum().backward();  // d/dx += 2 x w
  std::vector<double> g = values(x.grad());
  EXPECT_DOUBLE_EQ(g[0], 0.5 + 2 * 1.0 * 0.5);
  EXPECT_DOUBLE_EQ(g[1], 0.25 + 2 * -2.0 * 0.25);
  EXPECT_DOUBLE_EQ(g[2], -1.0 + 2 * 3.0 * -1.0);
  // w's gradient accumulated too: x, then x^2.
  std::vector<double> gw = values(w.grad());
  EXPECT_DOUBLE_EQ(gw[0], 1.0 + 1.0);
  EXPECT_DOUBLE_EQ(gw[1], -2.0 + 4.0);
  EXPECT_DOUBLE_EQ(gw[2], 3.0 + 9.0);
  x.zero_grad();
  EXPECT_FALSE(x.grad().defined());
  mul(x, w).sum().backward();
  EXPECT_EQ(values(x.grad()), values(w.detach()));
}

TEST(AutogradEngine, TheGradientDoesNotAliasTheIncomingBuffer) {
  Tensor x = leaf({1.0, 2.0}, {2});
  Tensor seed = leaf({3.0, 4.0}, {2}, cpu_device(0), false);
  Tensor y = x.mul(1.0);
  y.backward(seed);
  seed.fill_(0.0);
  EXPECT_EQ(values(x.grad()), (std::vector<double>{3.0, 4.0}));
}

TEST(AutogradEngine, ParameterUsedTwiceGetsTheSum) {
  Tensor w = leaf({2.0}, {});
  Tensor x = leaf({3.0}, {});
  Tensor y = add(mul(w, x), mul(w, w));  // dy/dw = x + 2w = 7
  y.backward();
  EXPECT_DOUBLE_EQ(w.grad().item(), 7.0);
  EXPECT_DOUBLE_EQ(x.grad().item(), 2.0);
}

TEST(AutogradEngine, NoGradGuardRecordsNothing) {
  Tensor x = random_leaf({2, 3}, 1);
  EXPECT_TRUE(grad_enabled());
  {
    NoGradGuard guard;
    EXPECT_FALSE(grad_enabled());
    Tensor y = x.mul(2.0).exp().sum();
    EXPECT_FALSE(y.requires_grad());
    EXPECT_FALSE(y.grad_fn());
    EXPECT_TRUE(y.is_leaf());
    Tensor v = x.t();
    EXPECT_FALSE(v.grad_fn());
    EXPECT_THROW(y.backward(), ValueError);
    {
      NoGradGuard nested;
    }
    EXPECT_FALSE(grad_enabled());  // the nested guard restored "off", not "on"
  }
  EXPECT_TRUE(grad_enabled());
  Tensor z = x.mul(2.0).sum();
  EXPECT_TRUE(z.requires_grad());
  EXPECT_TRUE(z.grad_fn() != nullptr);
  EXPECT_FALSE(x.grad().defined());
}

TEST(AutogradEngine, BackwardTwiceThroughAFreedGraphThrows) {
  Tensor x = random_leaf({3}, 2);
  Tensor loss = x.exp().mul(2.0).sum();
  loss.backward();
  EXPECT_TRUE(test::throws_naming<Error>([&] { loss.backward(); }, {"second time", "retain_graph"}));
}

TEST(AutogradEngine, RetainGraphAllowsASecondBackward) {
  Tensor x = leaf({0.5, -1.0}, {2});
  Tensor loss = x.exp().sum();
  loss.backward(Tensor(), /*retain_graph=*/true);
  std::vector<double> once = values(x.grad());
  loss.backward();  // retained: runs, and accumulates
  std::vector<double> twice = values(x.grad());
  for (size_t i = 0; i < once.size(); ++i) {
    EXPECT_DOUBLE_EQ(once[i], std::exp(i == 0 ? 0.5 : -1.0));
    EXPECT_DOUBLE_EQ(twice[i], 2 * once[i]);
  }
  // The second backward did not retain: a third one fails.
  EXPECT_THROW(loss.backward(), Error);
}

TEST(AutogradEngine, BackwardNeedsAScalarOrAGradient) {
  Tensor x = random_leaf({2, 2}, 3);
  Tensor y = x.mul(3.0);
  EXPECT_THROW(y.backward(), ValueError);
  EXPECT_THROW(y.backward(ones({3}, {kFloat64})), ValueError);
  y.backward(ones({2, 2}, {kFloat64}));
  for (double g : values(x.grad())) EXPECT_DOUBLE_EQ(g, 3.0);
}

TEST(AutogradEngine, PostAccumulateHookRunsOncePerBackwardWithTheFinalGradient) {
  Tensor w = leaf({1.0, 2.0}, {2});
  Tensor x = leaf({3.0, 5.0}, {2}, cpu_device(0), false);
  int calls = 0;
  std::vector<std::vector<double>> seen;
  w.register_post_accumulate_hook([&](Tensor& p) {
    ++calls;
    EXPECT_TRUE(p.is_same(w));
    seen.push_back(p.grad().to_vector<double>());
  });
  // w is used twice: the hook must see the sum x + 2w, not one of the parts.
  Tensor loss = add(mul(w, x), mul(w, w)).sum();
  loss.backward();
  ASSERT_EQ(calls, 1);
  EXPECT_EQ(seen[0], (std::vector<double>{3.0 + 2.0, 5.0 + 4.0}));
  // A second backward: one more call, seeing the accumulated gradient.
  add(mul(w, x), mul(w, w)).sum().backward();
  ASSERT_EQ(calls, 2);
  EXPECT_EQ(seen[1], (std::vector<double>{10.0, 18.0}));
}

TEST(AutogradEngine, HooksOnlyOnLeavesThatRequireGrad) {
  Tensor x = leaf({1.0}, {1}, cpu_device(0), false);
  EXPECT_THROW(x.register_post_accumulate_hook([](Tensor&) {}), ValueError);
  Tensor w = leaf({1.0}, {1});
  Tensor y = w.mul(2.0);
  EXPECT_THROW(y.register_post_accumulate_hook([](Tensor&) {}), ValueError);
}

TEST(AutogradEngine, LeavesOnTwoLogicalDevicesGetGradientsOnTheirOwnDevice) {
  const Device d0("cpu:0"), d1("cpu:1");
  Tensor a = leaf({1.0, 2.0, 3.0}, {3}, d0);
  Tensor b = leaf({4.0, 5.0, 6.0}, {3}, d1);
  // a * b runs on cpu:0 (first operand); the moved result is combined with b on cpu:1.
  Tensor ab = mul(a, b);
  EXPECT_EQ(ab.device(), d0);
  Tensor loss = mul(ab.to(d1), b).sum();  // sum(a * b^2)
  EXPECT_EQ(loss.device(), d1);
  loss.backward();
  ASSERT_TRUE(a.grad().defined() && b.grad().defined());
  EXPECT_EQ(a.grad().device(), d0);
  EXPECT_EQ(b.grad().device(), d1);
  EXPECT_EQ(values(a.grad()), (std::vector<double>{16.0, 25.0, 36.0}));   // b^2
  EXPECT_EQ(values(b.grad()), (std::vector<double>{8.0, 20.0, 36.0}));    // 2 a b
  // And by finite differences, with the operands the other way round.
  EXPECT_TRUE(test::gradcheck([d0](const TensorList& v) { return mul(v[1], v[0].exp()).to(d0); }, {a, b}));
}

TEST(AutogradEngine, LeafAndGradFnBookkeeping) {
  Tensor x = random_leaf({2}, 4);
  EXPECT_TRUE(x.is_leaf());
  EXPECT_TRUE(x.requires_grad());
  Tensor y = x.mul(2.0);
  EXPECT_FALSE(y.is_leaf());
  EXPECT_TRUE(y.requires_grad());
  Tensor d = y.detach();
  EXPECT_TRUE(d.is_leaf());
  EXPECT_FALSE(d.requires_grad());
  EXPECT_EQ(d.raw_data(), y.raw_data());
  EXPECT_THROW(y.set_requires_grad(false), ValueError);
  EXPECT_THROW(zeros({2}, {kInt64}).set_requires_grad(true), ValueError);
}

}  // namespace
}  // namespace chorus
