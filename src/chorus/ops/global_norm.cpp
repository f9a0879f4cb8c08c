#include "chorus/ops/global_norm.h"

#include <cmath>
#include <map>

#include "chorus/core/error.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/dispatch.h"
#include "chorus/ops/elementwise.h"
#include "chorus/ops/factory.h"
#include "chorus/ops/reduce.h"

namespace chorus::ops {

Tensor clip_by_global_norm_(const TensorList& grads, double max_norm, const Device& home, DType acc,
                            const std::function<void(const Tensor&)>& total_of) {
  // Note [Clipping in a few launches] (cuda/multi_tensor.cu): the gradients of
  // each device in one multi-tensor pass for the norm and one for the scale;
  // a gradient that is not contiguous (a view of something larger) on its own.
  std::map<Device, TensorList> dense;
  TensorList strided;
  for (const Tensor& g : grads) (g.is_contiguous() ? dense[g.device()] : strided).push_back(g);
  Tensor total;
  auto add = [&](Tensor sq) {
    sq = to_device(sq, home);
    total = total.defined() ? binary(BinaryOp::Add, total, sq) : sq;
  };
  for (const auto& [dev, gs] : dense) {
    Tensor sq = chorus::detail::empty_tensor({}, acc, dev);
    CHORUS_KERNEL(dev, sum_squares_multi, gs, sq);
    add(sq);
  }
  for (const Tensor& g : strided) {
    Tensor gf = to_dtype(g, acc);
    add(reduce(ReduceOp::Sum, binary(BinaryOp::Mul, gf, gf), {}, false));
  }
  if (!total.defined()) total = zeros({}, {acc, home});
  if (total_of) total_of(total);
  Tensor norm = unary(UnaryOp::Sqrt, total);
  if (!(max_norm > 0) || !std::isfinite(max_norm)) return norm;
  // coef = min(1, max_norm / (norm + 1e-6)), as PyTorch.
  Tensor coef = unary(UnaryOp::MulScalar, unary(UnaryOp::Reciprocal, unary(UnaryOp::AddScalar, norm, 1e-6)),
                           max_norm);
  coef = binary(BinaryOp::Min, coef, full({}, 1.0, {acc, home}));
  for (const auto& [dev, gs] : dense) CHORUS_KERNEL(dev, scale_multi, gs, to_device(coef, dev));
  for (Tensor g : strided) {
    Tensor c = to_dtype(to_device(coef, g.device()), g.dtype());
    binary_(BinaryOp::Mul, g, c);
  }
  return norm;
}


}  // namespace chorus::ops
