#include "chorus/optim/clip_grad.h"

#include "chorus/autograd/grad_mode.h"
#include "chorus/core/error.h"
#include "chorus/ops/global_norm.h"

namespace chorus::optim {

namespace {

TensorList grads_of(const std::vector<Tensor>& params, const char* op) {
  TensorList grads;
  for (const Tensor& p : params)
    if (Tensor g = p.grad(); g.defined()) grads.push_back(g);
  CHORUS_CHECK(!grads.empty(), op, ": no parameter has a gradient");
  return grads;
}

DType norm_dtype(const TensorList& grads) { return grads[0].dtype() == kFloat64 ? kFloat64 : kFloat32; }

}  // namespace

Tensor clip_grad_norm_(const std::vector<Tensor>& params, double max_norm) {
  NoGradGuard no_grad;
  const TensorList grads = grads_of(params, "clip_grad_norm_");
  return ops::clip_by_global_norm_(grads, max_norm, grads[0].device(), norm_dtype(grads));
}

ClipScale clip_grad_norm_scale(const std::vector<Tensor>& params, double max_norm) {
  NoGradGuard no_grad;
  const TensorList grads = grads_of(params, "clip_grad_norm_scale");
  ops::NormAndScale ns = ops::global_norm_and_scale(grads, max_norm, grads[0].device(), norm_dtype(grads));
  return {ns.norm, ns.scale};
}

Tensor clip_and_step(Optimizer& opt, const std::vector<Tensor>& params, double max_norm) {
  ClipScale c = clip_grad_norm_scale(params, max_norm);
  opt.step_scaled(c.scale);
  return c.norm;
}

}  // namespace chorus::optim
