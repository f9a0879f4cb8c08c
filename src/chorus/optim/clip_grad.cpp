#include "chorus/optim/clip_grad.h"

#include "chorus/autograd/grad_mode.h"
#include "chorus/core/error.h"
#include "chorus/ops/global_norm.h"

namespace chorus::optim {

Tensor clip_grad_norm_(const std::vector<Tensor>& params, double max_norm) {
  NoGradGuard no_grad;
  TensorList grads;
  for (const Tensor& p : params)
    if (Tensor g = p.grad(); g.defined()) grads.push_back(g);
  CHORUS_CHECK(!grads.empty(), "clip_grad_norm_: no parameter has a gradient");
  return ops::clip_by_global_norm_(grads, max_norm, grads[0].device(), grads[0].dtype() == kFloat64 ? kFloat64 : kFloat32);
}

}  // namespace chorus::optim
