// Backward formulas of the transformer ops (GELU, layer norm, attention, the
// fused classifier), beside those of nn_functions.cpp.
#include "chorus/autograd/transformer_functions.h"

#include <limits>

#include "chorus/autograd/node.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/elementwise.h"
#include "chorus/ops/factory.h"
#include "chorus/ops/reduce.h"
#include "chorus/ops/transformer.h"
#include "chorus/ops/views.h"

namespace chorus::autograd {

Tensor gelu(const Tensor& x, bool tanh_approximation) {
  Tensor xd = x.detach();
  const UnaryOp op = tanh_approximation ? UnaryOp::GeluTanh : UnaryOp::Gelu;
  const BinaryOp grad = tanh_approximation ? BinaryOp::GeluTanhGrad : BinaryOp::GeluGrad;
  return record("GeluBackward", ops::unary(op, x), {x}, [xd, grad](const TensorList& g) {
    return TensorList{ops::binary(grad, ops::to_dtype(g[0], xd.dtype()), xd)};
  });
}

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  auto [y, mean, rstd] = ops::layer_norm(x, weight, bias, eps);
  Tensor xd = x.detach(), wd = weight.defined() ? weight.detach() : Tensor();
  const bool has_w = weight.defined(), has_b = bias.defined();
  Tensor m = mean, r = rstd;
  TensorList inputs{x};
  if (has_w) inputs.push_back(weight);
  if (has_b) inputs.push_back(bias);
  return record("LayerNormBackward", y, inputs, [xd, wd, m, r, has_w, has_b](const TensorList& g) {
    auto [dx, dw, db] = ops::layer_norm_backward(g[0], xd, wd, m, r, has_w, has_b);
    TensorList out{dx};
    if (has_w) out.push_back(dw);
    if (has_b) out.push_back(db);
    return out;
  });
}

Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale, double dropout,
                 ops::AttentionKernel kernel) {
  ops::AttentionSaved saved = ops::attention(q, k, v, causal, scale, dropout, kernel);
  Tensor out = saved.out;
  // The backward keeps the output detached (the fused path reads it), not the
  // graph node that produced it.
  saved.out = saved.out.detach();
  Tensor qd = q.detach(), kd = k.detach(), vd = v.detach();
  return record("AttentionBackward", out, {q, k, v}, [qd, kd, vd, saved, causal, scale](const TensorList& g) {
    auto [dq, dk, dv] = ops::attention_backward(g[0], qd, kd, vd, saved, causal, scale);
    return TensorList{dq, dk, dv};
  });
}

Tensor cross_entropy_fused_mean(const Tensor& logits, const Tensor& target, int64_t valid_cols,
                                std::optional<int64_t> ignore_index) {
  // No target equals INT64_MIN: "no ignore index" to the kernels.
  const int64_t ignore = ignore_index.value_or(std::numeric_limits<int64_t>::min());
  auto [losses, dlogits] = ops::cross_entropy_fused(logits, target, valid_cols, ignore);
  const DType acc = losses.dtype();
  // The number of rows that count, on the device (no host wait): N, or the
  // targets that are not ignore_index (at least 1, so an all-ignored batch
  // gives 0 and no NaN).
  Tensor count;
  if (ignore_index) {
    Tensor tg = ops::to_device(target, logits.device());
    Tensor kept = ops::to_dtype(ops::binary(BinaryOp::Ne, tg, full({}, double(ignore), {tg.dtype(), tg.device()})), acc);
    count = ops::binary(BinaryOp::Max, ops::reduce(ReduceOp::Sum, kept, {}, false),
                        full({}, 1.0, {acc, logits.device()}));
  } else {
    count = full({}, static_cast<double>(std::max<int64_t>(logits.size(0), 1)), {acc, logits.device()});
  }
  Tensor loss = ops::binary(BinaryOp::Div, ops::reduce(ReduceOp::Sum, losses, {}, false), count);
  Tensor dl = dlogits, n = count;
  return record("CrossEntropyBackward", loss, {logits}, [dl, n](const TensorList& g) {
    // d loss / d logits[r] = g / count * (softmax - onehot)[r]; the scale
    // rounded to the logits' dtype once (exact for a power-of-two count).
    Tensor scale = ops::binary(BinaryOp::Div, ops::to_dtype(g[0], n.dtype()), n);
    return TensorList{ops::binary(BinaryOp::Mul, dl, ops::to_dtype(scale, dl.dtype()))};
  });
}

}  // namespace chorus::autograd
