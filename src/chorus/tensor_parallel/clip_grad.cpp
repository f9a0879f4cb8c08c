#include "chorus/tensor_parallel/clip_grad.h"

#include <cmath>

#include "chorus/autograd/grad_mode.h"
#include "chorus/ops/factory.h"
#include "chorus/tensor_parallel/mappings.h"

namespace chorus::tp {

Tensor clip_grad_norm_(const std::vector<ShardedParameter>& params, double max_norm,
                       const dist::ProcessGroupPtr& tp_group, const dist::ProcessGroupPtr& pp_group,
                       const std::vector<Tensor>& counted_elsewhere) {
  NoGradGuard no_grad;
  const bool count_replicated = !is_parallel(tp_group) || tp_group->rank() == 0;
  DType acc = kFloat32;
  Device dev = cpu_device(0);
  bool any = false;
  for (const auto& p : params) {
    if (!p.tensor.grad().defined()) continue;
    if (!any) dev = p.tensor.grad().device();
    if (p.tensor.grad().dtype() == kFloat64) acc = kFloat64;
    any = true;
  }
  Tensor squares = zeros({1}, {acc, dev});
  for (const auto& p : params) {
    const Tensor g = p.tensor.grad();
    if (!g.defined() || (p.spec.replicated() && !count_replicated)) continue;
    bool elsewhere = false;
    for (const Tensor& t : counted_elsewhere) elsewhere = elsewhere || t.is_same(p.tensor);
    if (elsewhere) continue;
    Tensor x = g.to(dev, acc);
    squares.add_(x.mul(x).sum().reshape({1}));
  }
  all_reduce_sum(squares, tp_group);
  all_reduce_sum(squares, pp_group);
  Tensor norm = squares.sqrt().reshape({});
  if (max_norm > 0 && std::isfinite(max_norm)) {
    // min(1, max_norm / (norm + 1e-6)), on the device: no host wait.
    Tensor coef = norm.add(1e-6).pow(-1.0).mul(max_norm);
    coef = coef.lt(full({}, 1.0, {acc, dev})).to(acc).mul(coef).add(coef.ge(full({}, 1.0, {acc, dev})).to(acc));
    for (const auto& p : params) {
      Tensor g = p.tensor.grad();
      if (g.defined()) g.mul_(coef.to(g.device(), g.dtype()));
    }
  }
  return norm;
}

}  // namespace chorus::tp
