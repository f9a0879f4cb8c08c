#include "chorus/optim/clip_grad.h"

#include <cmath>
#include <map>

#include "chorus/autograd/grad_mode.h"
#include "chorus/core/error.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/dispatch.h"
#include "chorus/ops/elementwise.h"
#include "chorus/ops/factory.h"
#include "chorus/ops/reduce.h"

namespace chorus::optim {

namespace {

Tensor clip(const std::vector<Tensor>& params, double max_norm, const Device& home, DType acc,
            const std::function<void(const Tensor&)>& total_of) {
  NoGradGuard no_grad;
  std::vector<Tensor> grads;
  for (const Tensor& p : params) {
    Tensor g = p.grad();
    if (g.defined()) grads.push_back(g);
  }
  // Note [Clipping in a few launches] (cuda/multi_tensor.cu): the gradients of
  // each device in one multi-tensor pass for the norm and one for the scale;
  // a gradient that is not contiguous (a view of something larger) on its own.
  std::map<Device, TensorList> dense;
  TensorList strided;
  for (const Tensor& g : grads) (g.is_contiguous() ? dense[g.device()] : strided).push_back(g);
  Tensor total;
  auto add = [&](Tensor sq) {
    sq = ops::to_device(sq, home);
    total = total.defined() ? ops::binary(BinaryOp::Add, total, sq) : sq;
  };
  for (const auto& [dev, gs] : dense) {
    Tensor sq = chorus::detail::empty_tensor({}, acc, dev);
    CHORUS_KERNEL(dev, sum_squares_multi, gs, sq);
    add(sq);
  }
  for (const Tensor& g : strided) {
    Tensor gf = ops::to_dtype(g, acc);
    add(ops::reduce(ReduceOp::Sum, ops::binary(BinaryOp::Mul, gf, gf), {}, false));
  }
  if (!total.defined()) total = zeros({}, {acc, home});
  if (total_of) total_of(total);
  Tensor norm = ops::unary(UnaryOp::Sqrt, total);
  if (!(max_norm > 0) || !std::isfinite(max_norm)) return norm;
  // coef = min(1, max_norm / (norm + 1e-6)), as PyTorch.
  Tensor coef = ops::unary(UnaryOp::MulScalar, ops::unary(UnaryOp::Reciprocal, ops::unary(UnaryOp::AddScalar, norm, 1e-6)),
                           max_norm);
  coef = ops::binary(BinaryOp::Min, coef, full({}, 1.0, {acc, home}));
  for (const auto& [dev, gs] : dense) CHORUS_KERNEL(dev, scale_multi, gs, ops::to_device(coef, dev));
  for (Tensor g : strided) {
    Tensor c = ops::to_dtype(ops::to_device(coef, g.device()), g.dtype());
    ops::binary_(BinaryOp::Mul, g, c);
  }
  return norm;
}

}  // namespace

Tensor clip_grad_norm_(const std::vector<Tensor>& params, double max_norm) {
  const Tensor* first = nullptr;
  for (const Tensor& p : params)
    if (p.grad().defined()) {
      first = &p;
      break;
    }
  CHORUS_CHECK(first != nullptr, "clip_grad_norm_: no parameter has a gradient");
  const Tensor g = first->grad();
  return clip(params, max_norm, g.device(), g.dtype() == kFloat64 ? kFloat64 : kFloat32, {});
}

Tensor clip_grad_norm_sharded_(const std::vector<Tensor>& params, double max_norm, const Device& home, DType acc,
                               const std::function<void(const Tensor&)>& total_of) {
  return clip(params, max_norm, home, acc, total_of);
}

}  // namespace chorus::optim
