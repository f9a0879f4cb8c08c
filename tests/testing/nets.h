// Small models several multi-device tests train.
#pragma once

#include <cstdint>
#include <memory>

#include <chorus/chorus.h>

namespace chorus::test {

// Conv (2 -> 6, no bias) + batch norm + ReLU + max pool + linear to 5 classes,
// for 2 x 8 x 8 inputs, initialised from `seed`. Batch norm's buffers share
// DataParallel's float32 flat group with the parameters.
inline std::shared_ptr<nn::Sequential> conv_bn_net(uint64_t seed) {
  manual_seed(seed);
  auto s = std::make_shared<nn::Sequential>();
  s->push_back(std::make_shared<nn::Conv2d>(nn::Conv2dOptions{2, 6, 3, 1, 1, 1, 1, false}));
  s->push_back(std::make_shared<nn::BatchNorm2d>(6));
  s->push_back(std::make_shared<nn::ReLU>());
  s->push_back(std::make_shared<nn::MaxPool2d>(nn::Pool2dOptions{2}));
  s->push_back(std::make_shared<nn::Flatten>());
  s->push_back(std::make_shared<nn::Linear>(6 * 4 * 4, 5));
  return s;
}

// x * (a + b), then a linear head to 5 classes, for inputs of 18 elements:
// a's and b's gradients are the one tensor the sum's backward passes to both.
class AddedScales : public nn::Module {
 public:
  explicit AddedScales(nn::NoOptions = {}) : Module("AddedScales") {
    register_parameter("a", randn({18}));
    register_parameter("b", randn({18}));
    head_ = register_module("head", std::make_shared<nn::Linear>(18, 5));
  }
  // Through the module's own slots, which DataParallel points at a replica's copies.
  Tensor forward(const Tensor& x) override {
    return head_->forward(x.flatten(1) * (own_parameters()[0].second + own_parameters()[1].second));
  }
  nn::NoOptions options_for_clone() const { return {}; }
  CHORUS_MODULE_CLONEABLE(AddedScales)
 private:
  std::shared_ptr<nn::Linear> head_;
};

// Two linear layers from 18 inputs to 5 classes; `extra` is used only by the
// replica on device index 1: the other replicas send zeros for it.
class UsedOnOneDevice : public nn::Module {
 public:
  explicit UsedOnOneDevice(nn::NoOptions = {}) : Module("UsedOnOneDevice") {
    lin = register_module("lin", std::make_shared<nn::Linear>(18, 5));
    extra = register_module("extra", std::make_shared<nn::Linear>(18, 5));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = x.flatten(1);
    Tensor y = lin->forward(h);
    if (x.device().index == 1) y = y + extra->forward(h);
    return y;
  }
  nn::NoOptions options_for_clone() const { return {}; }
  CHORUS_MODULE_CLONEABLE(UsedOnOneDevice)
  std::shared_ptr<nn::Linear> lin, extra;
};

}  // namespace chorus::test
