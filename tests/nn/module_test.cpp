// nn::Module: state-dict names, strict loading, deep clones with shared
// parameters, moving between devices in place, train/eval propagation.
#include <gtest/gtest.h>

#include <chorus/chorus.h>
#include <chorus/optim/sgd.h>

#include "testing/expect_error.h"

#include <algorithm>

namespace chorus::nn {
namespace {

std::vector<std::string> names(const NamedTensors& ts) {
  std::vector<std::string> out;
  for (const auto& [n, t] : ts) out.push_back(n);
  return out;
}

Tensor by_name(const NamedTensors& ts, const std::string& name) {
  for (const auto& [n, t] : ts)
    if (n == name) return t;
  throw std::runtime_error("no tensor named " + name);
}

// Modules live in shared_ptrs (modules() and clone() need shared_from_this).
std::shared_ptr<Sequential> seq(std::initializer_list<ModulePtr> mods) {
  auto s = std::make_shared<Sequential>();
  for (const ModulePtr& m : mods) s->push_back(m);
  return s;
}

std::shared_ptr<Sequential> small_net() {
  return seq({std::make_shared<Linear>(4, 8), std::make_shared<ReLU>(), std::make_shared<Linear>(8, 3)});
}

std::shared_ptr<Sequential> conv_net() {
  return seq({std::make_shared<Conv2d>(Conv2dOptions{3, 4, 3, 1, 1}), std::make_shared<BatchNorm2d>(4),
              std::make_shared<ReLU>(), std::make_shared<MaxPool2d>(Pool2dOptions{2}), std::make_shared<Dropout>(0.2),
              std::make_shared<AdaptiveAvgPool2d>(), std::make_shared<Flatten>(), std::make_shared<Linear>(4, 2, false)});
}

TEST(NNModule, StateDictNamesInASequential) {
  auto net = small_net();
  EXPECT_EQ(names(net->named_parameters()), (std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias"}));
  EXPECT_EQ(names(net->state_dict()), (std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias"}));
  EXPECT_EQ(by_name(net->state_dict(), "2.bias").sizes(), (Shape{3}));
  EXPECT_EQ(by_name(net->state_dict(), "0.weight").sizes(), (Shape{8, 4}));
  EXPECT_EQ(net->num_parameters(), 8 * 4 + 8 + 3 * 8 + 3);
  // Buffers follow the parameters, under the same dotted names.
  auto cnet = conv_net();
  EXPECT_EQ(names(cnet->state_dict()),
            (std::vector<std::string>{"0.weight", "0.bias", "1.weight", "1.bias", "7.weight", "1.running_mean",
                                      "1.running_var", "1.num_batches_tracked"}));
  EXPECT_EQ(names(cnet->named_buffers()),
            (std::vector<std::string>{"1.running_mean", "1.running_var", "1.num_batches_tracked"}));
  // Nested containers add a level.
  auto outer = seq({small_net(), std::make_shared<Linear>(3, 1)});
  EXPECT_EQ(names(outer->named_parameters())[0], "0.0.weight");
  EXPECT_EQ(names(outer->named_parameters()).back(), "1.bias");
  // The state dict holds the module's own tensors, not copies.
  EXPECT_TRUE(by_name(net->state_dict(), "0.weight").is_same(std::dynamic_pointer_cast<Linear>((*net)[0])->weight()));
}

TEST(NNModule, LoadStateDictCopiesValues) {
  auto a = small_net(), b = small_net();
  b->load_state_dict(a->state_dict());
  for (const auto& [n, t] : a->state_dict()) {
    Tensor u = by_name(b->state_dict(), n);
    EXPECT_FALSE(u.is_same(t)) << n;  // copied into b's own tensors
    EXPECT_EQ(u.to_vector<float>(), t.to_vector<float>()) << n;
  }
  // Loading into a model on another device converts.
  auto c = small_net();
  c->to(Device("cpu:1"));
  c->load_state_dict(a->state_dict());
  EXPECT_EQ(by_name(c->state_dict(), "0.weight").device(), cpu_device(1));
  EXPECT_EQ(by_name(c->state_dict(), "0.weight").to_vector<float>(), by_name(a->state_dict(), "0.weight").to_vector<float>());
}

TEST(NNModule, LoadStateDictStrictErrorsListWhatIsWrong) {
  auto net = small_net();
  NamedTensors sd = net->state_dict();
  NamedTensors missing(sd.begin(), sd.end() - 1);  // no "2.bias"
  NamedTensors unexpected = sd;
  unexpected.emplace_back("3.weight", zeros({2}));
  NamedTensors mismatched = sd;
  mismatched[0].second = zeros({4, 8});  // "0.weight" is [8, 4]
  auto expect_error = [&](const NamedTensors& state, std::initializer_list<std::string> parts) {
    EXPECT_TRUE(test::throws_naming([&] { net->load_state_dict(state); }, parts));
  };
  expect_error(missing, {"missing", "2.bias"});
  expect_error(unexpected, {"unexpected", "3.weight"});
  expect_error(mismatched, {"0.weight", "[4, 8]", "[8, 4]"});
  // Issue 15: a weight stored as int32 was converted and loaded.
  NamedTensors wrong_dtype = sd;
  wrong_dtype[0].second = sd[0].second.to(kInt32);
  expect_error(wrong_dtype, {"dtype mismatch", "0.weight (checkpoint int32, model float32)"});
  // All three at once are all listed.
  NamedTensors all(sd.begin() + 1, sd.end() - 1);
  all[0].second = zeros({7});
  all.emplace_back("extra", zeros({1}));
  expect_error(all, {"missing", "0.weight", "2.bias", "unexpected", "extra", "0.bias", "[7]"});
  // A failed load changes nothing.
  NamedTensors before = net->state_dict();
  std::vector<float> w_before = by_name(before, "2.weight").to_vector<float>();
  NamedTensors bad = sd;
  for (auto& [n, t] : bad) t = zeros(t.sizes());
  bad.emplace_back("extra", zeros({1}));
  EXPECT_THROW(net->load_state_dict(bad), ValueError);
  EXPECT_EQ(by_name(net->state_dict(), "2.weight").to_vector<float>(), w_before);
}

TEST(NNModule, CloneIsADeepCopy) {
  auto net = conv_net();
  net->eval();
  auto copy = std::dynamic_pointer_cast<Sequential>(net->clone());
  ASSERT_TRUE(copy);
  EXPECT_EQ(names(copy->state_dict()), names(net->state_dict()));
  EXPECT_FALSE(copy->is_training());
  for (const auto& [n, t] : net->state_dict()) {
    Tensor c = by_name(copy->state_dict(), n);
    EXPECT_NE(c.storage(), t.storage()) << n;
    EXPECT_EQ(c.requires_grad(), t.requires_grad()) << n;
    if (is_floating(t.dtype())) EXPECT_EQ(c.to_vector<float>(), t.to_vector<float>()) << n;
  }
  // Changing the clone leaves the original alone.
  std::vector<float> orig = by_name(net->state_dict(), "0.weight").to_vector<float>();
  by_name(copy->state_dict(), "0.weight").fill_(3.0);
  by_name(copy->state_dict(), "1.running_mean").fill_(5.0);
  EXPECT_EQ(by_name(net->state_dict(), "0.weight").to_vector<float>(), orig);
  EXPECT_EQ(by_name(net->state_dict(), "1.running_mean").to_vector<float>(), std::vector<float>(4, 0.0f));
  // The copy computes what the original does.
  Tensor x = randn({2, 3, 6, 6});
  auto fresh = std::dynamic_pointer_cast<Sequential>(net->clone());
  EXPECT_EQ(fresh->forward(x).to_vector<float>(), net->forward(x).to_vector<float>());
  // Gradients of the clone go to the clone.
  fresh->train();
  Tensor loss = fresh->forward(x).sum();
  loss.backward();
  for (const Tensor& p : net->parameters()) EXPECT_FALSE(p.grad().defined());
  for (const Tensor& p : fresh->parameters()) EXPECT_TRUE(p.grad().defined());
  // Cloning does not consume the user's random stream.
  manual_seed(9);
  std::vector<float> r1 = rand({4}).to_vector<float>();
  manual_seed(9);
  net->clone();
  EXPECT_EQ(rand({4}).to_vector<float>(), r1);
}

TEST(NNModule, CloneKeepsSharedParametersShared) {
  // Layers 0 and 2 share one weight (tied, as in an autoencoder with a square layer).
  auto net = seq({std::make_shared<Linear>(4, 4), std::make_shared<ReLU>(), std::make_shared<Linear>(4, 4)});
  auto l0 = std::dynamic_pointer_cast<Linear>((*net)[0]);
  auto l2 = std::dynamic_pointer_cast<Linear>((*net)[2]);
  l2->weight() = l0->weight();
  ASSERT_TRUE(l2->weight().is_same(l0->weight()));
  // Shared tensors are listed once, under their first name.
  EXPECT_EQ(names(net->named_parameters()), (std::vector<std::string>{"0.weight", "0.bias", "2.bias"}));
  auto copy = std::dynamic_pointer_cast<Sequential>(net->clone());
  auto c0 = std::dynamic_pointer_cast<Linear>((*copy)[0]);
  auto c2 = std::dynamic_pointer_cast<Linear>((*copy)[2]);
  EXPECT_TRUE(c0->weight().is_same(c2->weight()));     // still shared inside the copy
  EXPECT_FALSE(c0->weight().is_same(l0->weight()));    // but not with the original
  EXPECT_EQ(names(copy->named_parameters()), names(net->named_parameters()));
  c0->weight().fill_(1.0);
  EXPECT_EQ(c2->weight().to_vector<float>(), std::vector<float>(16, 1.0f));
  EXPECT_NE(l0->weight().to_vector<float>(), std::vector<float>(16, 1.0f));
  // A tied weight gets the sum of both uses' gradients, once.
  Tensor x = randn({3, 4});
  copy->forward(x).sum().backward();
  EXPECT_TRUE(c0->weight().grad().defined());
}

TEST(NNModule, CloneToAnotherDevice) {
  auto net = small_net();
  auto copy = net->clone(Device("cpu:2"));
  for (const Tensor& p : copy->parameters()) EXPECT_EQ(p.device(), cpu_device(2));
  for (const Tensor& p : net->parameters()) EXPECT_EQ(p.device(), cpu_device(0));
  EXPECT_EQ(copy->device(), cpu_device(2));
  Tensor x = randn({2, 4});
  EXPECT_EQ(copy->forward(x.to(Device("cpu:2"))).to_vector<float>(), net->forward(x).to_vector<float>());
}

TEST(NNModule, ToDeviceKeepsTensorIdentity) {
  auto net = conv_net();
  std::vector<Tensor> held = net->parameters();  // what an optimizer holds
  NamedTensors buffers = net->named_buffers();
  Tensor w = by_name(net->state_dict(), "0.weight");
  std::vector<float> w_values = w.to_vector<float>();
  optim::SGD sgd(net->parameters(), {0.1});
  net->to(Device("cpu:1"));
  EXPECT_EQ(net->device(), cpu_device(1));
  for (const Tensor& p : held) EXPECT_EQ(p.device(), cpu_device(1));
  for (const Tensor& p : sgd.params()) EXPECT_EQ(p.device(), cpu_device(1));
  for (const auto& [n, b] : buffers) EXPECT_EQ(b.device(), cpu_device(1)) << n;
  EXPECT_TRUE(w.is_same(by_name(net->state_dict(), "0.weight")));
  EXPECT_EQ(w.to_vector<float>(), w_values);
  EXPECT_TRUE(w.requires_grad());
  EXPECT_TRUE(w.is_leaf());
  // Training on the new device updates the tensors the optimizer holds.
  Tensor x = randn({2, 3, 6, 6}, {kFloat32, Device("cpu:1")});
  net->forward(x).sum().backward();
  EXPECT_EQ(w.grad().device(), cpu_device(1));
  sgd.step();
  EXPECT_NE(w.to_vector<float>(), w_values);
  EXPECT_EQ(w.device(), cpu_device(1));
  // Moving back carries the gradient along.
  net->to(Device("cpu:0"));
  EXPECT_EQ(w.device(), cpu_device(0));
  EXPECT_EQ(w.grad().device(), cpu_device(0));
  EXPECT_THROW(net->to(cpu_device(cpu_device_count())), ValueError);
}

TEST(NNModule, ToDtypeCastsFloatingTensorsInPlace) {
  auto net = conv_net();
  Tensor w = by_name(net->state_dict(), "0.weight");
  net->to(kFloat64);
  EXPECT_EQ(w.dtype(), kFloat64);
  EXPECT_EQ(by_name(net->state_dict(), "1.running_var").dtype(), kFloat64);
  EXPECT_EQ(by_name(net->state_dict(), "1.num_batches_tracked").dtype(), kInt64);  // integers untouched
}

TEST(NNModule, TrainEvalPropagates) {
  auto inner = small_net();
  auto outer = seq({inner, conv_net()});
  EXPECT_TRUE(outer->is_training());
  outer->eval();
  for (const auto& m : outer->modules()) EXPECT_FALSE(m->is_training()) << m->type_name();
  outer->train();
  for (const auto& m : outer->modules()) EXPECT_TRUE(m->is_training()) << m->type_name();
  inner->eval();  // a child alone
  EXPECT_TRUE(outer->is_training());
  EXPECT_FALSE((*inner)[0]->is_training());
  EXPECT_EQ(outer->modules().size(), 1u + 4u + 9u);
}

TEST(NNModule, EvalModeChangesDropoutAndBatchNorm) {
  auto net = conv_net();
  Tensor x = randn({4, 3, 6, 6});
  net->eval();
  Tensor a = net->forward(x), b = net->forward(x);
  EXPECT_EQ(a.to_vector<float>(), b.to_vector<float>());  // no dropout, running stats fixed
  EXPECT_EQ(by_name(net->state_dict(), "1.num_batches_tracked").item(), 0);
  net->train();
  net->forward(x);
  EXPECT_EQ(by_name(net->state_dict(), "1.num_batches_tracked").item(), 1);
  EXPECT_NE(by_name(net->state_dict(), "1.running_mean").to_vector<float>(), std::vector<float>(4, 0.0f));
}

TEST(NNModule, ZeroGradAndPrinting) {
  auto net = small_net();
  net->forward(randn({2, 4})).sum().backward();
  for (const Tensor& p : net->parameters()) EXPECT_TRUE(p.grad().defined());
  net->zero_grad();
  for (const Tensor& p : net->parameters()) EXPECT_FALSE(p.grad().defined());
  std::string s = net->str();
  EXPECT_NE(s.find("Sequential"), std::string::npos) << s;
  EXPECT_NE(s.find("(0): Linear"), std::string::npos) << s;
  EXPECT_NE(s.find("(1): ReLU"), std::string::npos) << s;
}

}  // namespace
}  // namespace chorus::nn
