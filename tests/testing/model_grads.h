// The loss a function computes and every parameter's gradient of a model
// after one backward from it (the model's gradients zeroed first): two ways of
// running one model compared tensor by tensor.
#pragma once

#include <functional>
#include <vector>

#include <chorus/chorus.h>

namespace chorus::test {

inline std::vector<Tensor> loss_and_grads(nn::Module& model, const std::function<Tensor()>& loss_fn) {
  model.zero_grad();
  Tensor loss = loss_fn();
  loss.backward();
  std::vector<Tensor> out{loss.detach()};
  for (const auto& [name, p] : model.named_parameters()) out.push_back(p.grad().clone());
  return out;
}

}  // namespace chorus::test
