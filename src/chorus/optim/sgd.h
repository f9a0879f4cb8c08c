// SGD with momentum, Nesterov momentum and (coupled, L2) weight decay:
// torch.optim.SGD, step for step.
//
// Parameters are updated by fused kernels (kernel_set.h: sgd_update_multi, one
// launch per device for a whole model on a GPU),
// so a step costs one pass over param, grad and buffer per parameter instead
// of the four or five elementwise ops of the textbook formula. The momentum
// buffer is created on the parameter's first update and seeded with that
// gradient undamped, as PyTorch does.
#pragma once

#include "chorus/optim/optimizer.h"

namespace chorus::optim {

struct SGDOptions {
  double lr = 0.01;
  double momentum = 0;
  double dampening = 0;
  double weight_decay = 0;
  bool nesterov = false;
};

class SGD : public Optimizer {
 public:
  // Throws ValueError for lr, momentum or weight decay < 0, and for Nesterov
  // without momentum > 0 and dampening 0.
  SGD(std::vector<Tensor> params, SGDOptions options);
  void step() override;
  const SGDOptions& options() const { return options_; }

 protected:
  // Without momentum SGD keeps no buffer, and a snapshot with one is not its.
  std::vector<std::string> buffer_names() const override {
    return options_.momentum != 0 ? std::vector<std::string>{"momentum_buffer"} : std::vector<std::string>{};
  }

 private:
  SGDOptions options_;
};

}  // namespace chorus::optim
