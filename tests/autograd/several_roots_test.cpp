// One backward pass from several roots (Note [Several roots] in
// autograd/engine.h): against the backward of their sum, and against closed
// forms where one root reaches another, a root is given twice, or the roots
// are not scalars; roots on three logical CPU devices sharing one leaf; bad
// arguments.
#include <gtest/gtest.h>

#include <chorus/chorus.h>

#include <vector>

#include "testing/expect_error.h"
#include "testing/gradcheck.h"

namespace chorus {
namespace several_roots_test {  // names of its own in the unity build
namespace {

using test::random_leaf;

std::vector<double> values(const Tensor& t) { return t.to(cpu_device(0)).to_vector<double>(); }

void expect_near(const std::vector<double>& got, const std::vector<double>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-12 * (1 + std::abs(want[i]))) << i;
}

// a = sum(tanh(x) * w) on cpu:0, b = sum(exp(x on cpu:1) * v) on cpu:1.
struct TwoDeviceLosses {
  Tensor x = random_leaf({5, 3}, 11), w = random_leaf({5, 3}, 12), v = random_leaf({5, 3}, 13, cpu_device(1));
  Tensor a() const { return mul(tanh(x), w).sum(); }
  Tensor b() const { return mul(exp(to_device(x, cpu_device(1))), v).sum(); }
};

TEST(SeveralRoots, TwoDevicesGiveTheGradientsOfTheSum) {
  TwoDeviceLosses ref;
  add(ref.a(), to_device(ref.b(), cpu_device(0))).backward();
  TwoDeviceLosses got;
  backward({got.a(), got.b()});
  expect_near(values(got.x.grad()), values(ref.x.grad()));
  expect_near(values(got.w.grad()), values(ref.w.grad()));
  expect_near(values(got.v.grad()), values(ref.v.grad()));
  EXPECT_EQ(got.v.grad().device(), cpu_device(1));
}

TEST(SeveralRoots, ARootReachedFromAnotherGetsItsSeedAndWhatFlowsIn) {
  Tensor x = random_leaf({4}, 21);
  Tensor r1 = mul(x, x).sum();
  Tensor r2 = mul_scalar(r1, 3.0);
  backward({r2, r1});  // d/dx = (3 + 1) * 2x
  std::vector<double> want = values(x.detach());
  for (double& e : want) e *= 8.0;
  expect_near(values(x.grad()), want);
}

TEST(SeveralRoots, ARootGivenTwiceCountsTwice) {
  Tensor x = random_leaf({4}, 31);
  Tensor r = mul(x, x).sum();
  backward({r, r});
  std::vector<double> want = values(x.detach());
  for (double& e : want) e *= 4.0;
  expect_near(values(x.grad()), want);
}

TEST(SeveralRoots, GivenGradientsSeedTheirOwnRoots) {
  Tensor x = random_leaf({3}, 41);
  Tensor gu = random_leaf({3}, 42).detach(), gv = random_leaf({3}, 43).detach();
  Tensor u = mul(x, x), v = mul_scalar(x, -2.0);
  backward({u, v}, {gu, gv});  // d/dx = 2x gu - 2 gv
  const std::vector<double> xs = values(x.detach()), a = values(gu), b = values(gv);
  std::vector<double> want(3);
  for (size_t i = 0; i < 3; ++i) want[i] = 2 * xs[i] * a[i] - 2 * b[i];
  expect_near(values(x.grad()), want);
}

// Three device threads at once, all reaching one leaf on cpu:0.
TEST(SeveralRoots, RootsOnThreeDevicesShareALeaf) {
  Tensor w = random_leaf({6}, 51);
  TensorList roots;
  for (int d = 0; d < 3; ++d) {
    Tensor here = to_device(w, cpu_device(d));
    roots.push_back(mul_scalar(mul(here, here), d + 1.0).sum());
  }
  backward(roots);  // d/dw = (1 + 2 + 3) * 2w
  std::vector<double> want = values(w.detach());
  for (double& e : want) e *= 12.0;
  expect_near(values(w.grad()), want);
}

TEST(SeveralRoots, BadArgumentsAreNamed) {
  Tensor x = random_leaf({3}, 61);
  Tensor r = mul(x, x).sum();
  EXPECT_TRUE(test::throws_naming([&] { backward(TensorList{}); }, {"backward", "no tensors"}));
  EXPECT_TRUE(test::throws_naming([&] { backward({r, r}, {ones({}, {kFloat64})}); }, {"2 tensors", "1 gradients"}));
  Tensor plain = ones({}, {kFloat64});
  EXPECT_TRUE(test::throws_naming([&] { backward({r, plain}); }, {"tensors[1]", "does not require grad"}));
  EXPECT_TRUE(test::throws_naming([&] { backward({r, mul(x, x)}); }, {"implied only for a tensor with one element"}));
}

}  // namespace
}  // namespace several_roots_test
}  // namespace chorus
