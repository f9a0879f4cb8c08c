// Note [Placement that holds] and Note [Parameters on another device]: a
// module moved to another device runs there whatever device its input comes
// from (the seeds' model-parallel Net with no .to() in forward), and a
// trainable parameter copied to another device by a hand-written op warns
// once, naming it and both devices, or is an error under the strict policy.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "chorus/chorus.h"
#include "chorus/ops/copy.h"
#include "testing/random.h"

namespace chorus {
namespace {

double rel_err(const Tensor& a, const Tensor& b) {
  const std::vector<double> u = a.to(cpu_device(0)).to(kFloat64).to_vector<double>();
  const std::vector<double> v = b.to(cpu_device(0)).to(kFloat64).to_vector<double>();
  double num = 0, den = 0;
  for (size_t i = 0; i < u.size(); ++i) num += (u[i] - v[i]) * (u[i] - v[i]), den += v[i] * v[i];
  return std::sqrt(num / std::max(den, 1e-30));
}

std::shared_ptr<nn::Sequential> mlp(uint64_t seed) {
  manual_seed(seed);
  return std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
      std::make_shared<nn::Linear>(12, 16), std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(16, 16),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(16, 3)});
}

// The model-parallel program: the second half moved to cpu:1, no hop in forward.
TEST(Placement, ModelParallelNeedsNoTransferInForwardAndMatchesOneDevice) {
  auto one = mlp(7), split = mlp(7);
  for (size_t i = 2; i < 5; ++i) split->named_children()[i].second->to(Device("cpu:1"));
  manual_seed(3);
  Tensor x = randn({8, 12});
  Tensor y = randint(0, 3, {8});
  Tensor out = split->forward(x);
  EXPECT_EQ(out.device(), Device("cpu:1")) << "the output is where the last layer lives";
  nn::functional::cross_entropy(out, y.to(out.device())).backward();
  nn::functional::cross_entropy(one->forward(x), y).backward();
  auto a = split->named_parameters(), b = one->named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].second.grad().device(), a[i].second.device()) << a[i].first << ": gradient on its own device";
    EXPECT_LE(rel_err(a[i].second.grad(), b[i].second.grad()), 1e-6) << a[i].first;
  }
  EXPECT_EQ(a[2].second.device(), Device("cpu:1"));
  EXPECT_EQ(a[0].second.device(), Device("cpu:0"));
}

TEST(Placement, ConvAndBatchNormRunOnTheirParametersDevice) {
  manual_seed(5);
  auto conv = std::make_shared<nn::Conv2d>(nn::Conv2dOptions{2, 4, 3, 1, 1});
  auto bn = std::make_shared<nn::BatchNorm2d>(4);
  conv->to(Device("cpu:1"));
  bn->to(Device("cpu:1"));
  Tensor x = randn({2, 2, 5, 5});
  Tensor y = bn->forward(conv->forward(x));
  EXPECT_EQ(y.device(), Device("cpu:1"));
}

// A hand-written op that uses a parameter of cpu:1 with an input on cpu:0.
TEST(Placement, ParameterCopiedAcrossDevicesWarnsOnceOrIsAnError) {
  auto lin = std::make_shared<nn::Linear>(4, 4);
  lin->to(Device("cpu:1"));
  Tensor x = randn({4, 4});
  ::testing::internal::CaptureStderr();
  Tensor y1 = x * lin->weight();  // runs on cpu:0: the weight is copied there
  Tensor y2 = x * lin->weight();
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("Linear.weight"), std::string::npos) << err;
  EXPECT_NE(err.find("cpu:1"), std::string::npos) << err;
  EXPECT_NE(err.find("cpu:0"), std::string::npos) << err;
  EXPECT_EQ(err.find("Linear.weight"), err.rfind("Linear.weight")) << "once, not per use: " << err;

  ops::set_parameter_copy_policy(ops::ParameterCopy::Error);
  EXPECT_THROW(x * lin->weight(), ValueError);
  ops::set_parameter_copy_policy(ops::ParameterCopy::Warn);
  // A plain tensor (no grad) moves silently, as before.
  Tensor plain = randn({4, 4}, Device("cpu:1"));
  ::testing::internal::CaptureStderr();
  Tensor y3 = x * plain;
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
}

}  // namespace
}  // namespace chorus
