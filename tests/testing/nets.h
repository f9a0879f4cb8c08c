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

}  // namespace chorus::test
