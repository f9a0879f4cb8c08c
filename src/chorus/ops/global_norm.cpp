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

namespace {
// Note [Clipping in a few launches] (cuda/kernels/multi_tensor.cu): the tensors of
// each device in one multi-tensor pass; one that is not contiguous (a view of
// something larger) on its own.
struct ByDevice {
  std::map<Device, TensorList> dense;
  TensorList strided;
  explicit ByDevice(const TensorList& xs) {
    for (const Tensor& x : xs) (x.is_contiguous() ? dense[x.device()] : strided).push_back(x);
  }
};
}  // namespace

NormAndScale global_norm_and_scale(const TensorList& grads, double max_norm, const Device& home, DType acc,
                                   const std::function<void(const Tensor&)>& total_of) {
  const ByDevice by(grads);
  Tensor total;
  auto add = [&](Tensor sq) {
    sq = to_device(sq, home);
    total = total.defined() ? binary(BinaryOp::Add, total, sq) : sq;
  };
  for (const auto& [dev, gs] : by.dense) {
    Tensor sq = chorus::detail::empty_tensor({}, acc, dev);
    CHORUS_KERNEL(dev, sum_squares_multi, gs, sq);
    add(sq);
  }
  for (const Tensor& g : by.strided) {
    Tensor gf = to_dtype(g, acc);
    add(reduce(ReduceOp::Sum, binary(BinaryOp::Mul, gf, gf), {}, false));
  }
  if (!total.defined()) total = zeros({}, {acc, home});
  if (total_of) total_of(total);
  NormAndScale out;
  out.norm = unary(UnaryOp::Sqrt, total);
  if (!(max_norm > 0) || !std::isfinite(max_norm)) return out;
  // coef = min(1, max_norm / (norm + 1e-6)), as PyTorch.
  Tensor coef = unary(UnaryOp::MulScalar, unary(UnaryOp::Reciprocal, unary(UnaryOp::AddScalar, out.norm, 1e-6)),
                      max_norm);
  out.scale = binary(BinaryOp::Min, coef, full({}, 1.0, {acc, home}));
  return out;
}

void scale_by_(const TensorList& xs, const Tensor& scale) {
  CHORUS_CHECK(scale.defined() && scale.numel() == 1 && (scale.dtype() == kFloat32 || scale.dtype() == kFloat64),
               "scale_by_: the scale must be one float32 or float64 element, got ",
               scale.defined() ? scale.describe() : std::string("undefined"));
  const ByDevice by(xs);
  for (const auto& [dev, gs] : by.dense) CHORUS_KERNEL(dev, scale_multi, gs, to_device(scale, dev));
  for (Tensor g : by.strided) {
    Tensor c = to_dtype(to_device(scale, g.device()), g.dtype());
    binary_(BinaryOp::Mul, g, c);
  }
}

Tensor clip_by_global_norm_(const TensorList& grads, double max_norm, const Device& home, DType acc,
                            const std::function<void(const Tensor&)>& total_of) {
  NormAndScale ns = global_norm_and_scale(grads, max_norm, home, acc, total_of);
  if (ns.scale.defined()) scale_by_(grads, ns.scale);
  return ns.norm;
}

}  // namespace chorus::ops
