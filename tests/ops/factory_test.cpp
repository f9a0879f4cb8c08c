// Factories: values, dtypes, devices, requires_grad, and argument errors.
#include <gtest/gtest.h>

#include <chorus/chorus.h>

#include "testing/expect_error.h"

namespace chorus {
namespace {

TEST(OpsFactory, FilledTensors) {
  EXPECT_EQ(zeros({2, 3}).to_vector<float>(), std::vector<float>(6, 0.0f));
  EXPECT_EQ(ones({4}, {kInt64}).to_vector<int64_t>(), std::vector<int64_t>(4, 1));
  EXPECT_EQ(full({2, 2}, -1.5, {kFloat64}).to_vector<double>(), std::vector<double>(4, -1.5));
  EXPECT_EQ(full({3}, 0.1, {kBFloat16}).to_vector<float>(), std::vector<float>(3, static_cast<float>(BFloat16(0.1f))));
  EXPECT_EQ(scalar_tensor(2.5).dim(), 0);
  EXPECT_EQ(scalar_tensor(2.5).item(), 2.5);
  Tensor t = randn({2, 3}, {kFloat32, Device("cpu:1")});
  EXPECT_EQ(zeros_like(t).device(), cpu_device(1));
  EXPECT_EQ(ones_like(t).sizes(), (Shape{2, 3}));
  EXPECT_EQ(empty_like(t.to(kFloat64)).dtype(), kFloat64);
  EXPECT_EQ(zeros({0}).numel(), 0);
  EXPECT_THROW(zeros({2, -1}), ValueError);
  TensorOptions o(kFloat64);
  o.requires_grad = true;
  Tensor g = zeros({2}, o);
  EXPECT_TRUE(g.requires_grad());
  EXPECT_TRUE(g.is_leaf());
}

TEST(OpsFactory, Arange) {
  EXPECT_EQ(arange(5).to_vector<int64_t>(), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(arange(5).dtype(), kInt64);
  EXPECT_EQ(arange(2, 11, 3).to_vector<int64_t>(), (std::vector<int64_t>{2, 5, 8}));
  EXPECT_EQ(arange(0, 1, 0.25, {kFloat32}).to_vector<float>(), (std::vector<float>{0, 0.25f, 0.5f, 0.75f}));
  EXPECT_EQ(arange(3, 0, -1).to_vector<int64_t>(), (std::vector<int64_t>{3, 2, 1}));
  EXPECT_EQ(arange(3, 3).numel(), 0);
  EXPECT_THROW(arange(0, 1, 0), ValueError);
}

TEST(OpsFactory, FromVector) {
  Tensor f = from_vector(std::vector<float>{1, 2, 3, 4, 5, 6}, {2, 3});
  EXPECT_EQ(f.sizes(), (Shape{2, 3}));
  EXPECT_EQ(f.dtype(), kFloat32);
  EXPECT_EQ(f.to_vector<float>(), (std::vector<float>{1, 2, 3, 4, 5, 6}));
  Tensor d = from_vector(std::vector<double>{0.1, 0.2}, {2}, {kFloat64, Device("cpu:3")});
  EXPECT_EQ(d.device(), cpu_device(3));
  EXPECT_EQ(d.to_vector<double>(), (std::vector<double>{0.1, 0.2}));  // every bit kept
  EXPECT_EQ(from_vector(std::vector<double>{0.1}, {1}).to_vector<float>()[0], 0.1f);
  EXPECT_EQ(from_vector(std::vector<double>{2.9, -2.9}, {2}, {kInt64}).to_vector<int64_t>(), (std::vector<int64_t>{2, -2}));
  Tensor i = from_vector(std::vector<int64_t>{7, 8}, {2, 1});
  EXPECT_EQ(i.dtype(), kInt64);
  EXPECT_EQ(from_vector(std::vector<int64_t>{7, 8}, {2}, {kFloat32}).to_vector<float>(), (std::vector<float>{7, 8}));
  // The tensor owns a copy.
  std::vector<float> host = {1, 2};
  Tensor c = from_vector(host, {2});
  host[0] = 100;
  EXPECT_EQ(c.to_vector<float>()[0], 1);
  EXPECT_TRUE(test::throws_naming([] { from_vector(std::vector<float>{1, 2, 3}, {2, 2}); }, {"from_vector", "[2, 2]"}));
}

TEST(OpsFactory, RandomFactoriesRespectOptions) {
  EXPECT_EQ(rand({3}, {kFloat64}).dtype(), kFloat64);
  EXPECT_EQ(randn({3}, {kBFloat16}).dtype(), kBFloat16);
  EXPECT_EQ(randint(0, 5, {3}, {kInt32}).dtype(), kInt32);
  EXPECT_THROW(rand({3}, {kInt64}), ValueError);
  EXPECT_THROW(randn({3}, {kBool}), ValueError);
  EXPECT_THROW(randint(5, 5, {3}), ValueError);
  std::vector<int64_t> r = randint(10, 12, {100}).to_vector<int64_t>();
  for (int64_t v : r) {
    EXPECT_GE(v, 10);
    EXPECT_LT(v, 12);
  }
  Tensor u = empty({1000});
  u.uniform_(-3, -2);
  std::vector<float> uv = u.to_vector<float>();
  for (float v : uv) {
    EXPECT_GE(v, -3.0f);
    EXPECT_LE(v, -2.0f);
  }
}

}  // namespace
}  // namespace chorus
