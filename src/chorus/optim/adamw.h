// AdamW (Loshchilov & Hutter, decoupled weight decay): torch.optim.AdamW,
// step for step (amsgrad off).
//
// One fused kernel per parameter (kernel_set.h's adamw_update). The step that
// drives bias correction is counted per parameter, as PyTorch does, so a
// parameter that missed some steps (no gradient) is corrected by its own count.
#pragma once

#include "chorus/optim/optimizer.h"

namespace chorus::optim {

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  // Parameter groups by weight decay (PyTorch's param_groups for the one
  // setting that differs between them in practice): empty, or one decay per
  // parameter given to the constructor (GPTs decay their matrices only).
  std::vector<double> param_weight_decay;
};

class AdamW : public Optimizer {
 public:
  // Throws ValueError for lr < 0, betas outside [0, 1), eps <= 0, weight decay < 0.
  AdamW(std::vector<Tensor> params, AdamWOptions options);
  void step() override;
  // Note [Clipping in the update] (optim/clip_grad.h): the scale is read by
  // the fused kernel as it reads each gradient; the gradients stay as they
  // are. A strided (non-dense) parameter's update reads a scaled copy.
  void step_scaled(const Tensor& grad_scale) override;
  const AdamWOptions& options() const { return options_; }

 protected:
  std::vector<std::string> buffer_names() const override { return {"exp_avg", "exp_avg_sq"}; }
  // Parameter i's weight decay (i over params_, replicas included).
  double weight_decay_of(size_t i) const;

 private:
  // step() or step_scaled() (grad_scale undefined: none).
  void update(const Tensor& grad_scale);
  AdamWOptions options_;
};

}  // namespace chorus::optim
