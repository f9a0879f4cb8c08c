// Backward formulas of the transformer ops (GELU, layer norm, attention, the
// fused classifier), beside those of nn_functions.cpp.
#include "chorus/autograd/transformer_functions.h"

#include <array>
#include <limits>
#include <tuple>

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

std::pair<Tensor, Tensor> add_layer_norm(const Tensor& x, const Tensor& r, const Tensor& weight, const Tensor& bias,
                                         double eps) {
  auto [sum, y, mean, rstd] = ops::add_layer_norm(x, r, weight, bias, eps);
  // The backward reads the sum (the norm's input), which the residual stream
  // keeps anyway: nothing is saved that add + layer_norm would not save.
  Tensor sd = sum.detach(), wd = weight.defined() ? weight.detach() : Tensor();
  const bool has_w = weight.defined(), has_b = bias.defined();
  Tensor m = mean, rs = rstd;
  TensorList inputs{x, r};
  if (has_w) inputs.push_back(weight);
  if (has_b) inputs.push_back(bias);
  TensorList out = record("AddLayerNormBackward", {sum, y}, inputs, [sd, wd, m, rs, has_w, has_b](const TensorList& g) {
    // g[0]: the sum's gradient (the residual path), g[1]: the norm's; either
    // may be missing. Both addends get d(sum) + the norm's input gradient.
    Tensor dx, dw, db;
    if (g[1].defined()) {
      std::tie(dx, dw, db) = ops::layer_norm_backward(g[1], sd, wd, m, rs, has_w, has_b, g[0]);
    } else if (g[0].defined()) {
      dx = g[0];
    }
    TensorList grads{dx, dx};
    if (has_w) grads.push_back(dw);
    if (has_b) grads.push_back(db);
    return grads;
  });
  return {out[0], out[1]};
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

namespace {

// q, k, v [B, H, T, D]: views of a packed [B, T, 3 H D] tensor, q, k and v side by side.
std::array<Tensor, 3> packed_heads(const Tensor& qkv, int64_t heads) {
  const int64_t b = qkv.size(0), t = qkv.size(1), c = qkv.size(2) / 3;
  std::array<Tensor, 3> out;
  for (int64_t i = 0; i < 3; ++i)
    out[i] = ops::permute(ops::view(ops::slice(qkv, 2, i * c, (i + 1) * c, 1), {b, t, heads, c / heads}),
                          {0, 2, 1, 3});
  return out;
}

}  // namespace

Tensor attention_packed(const Tensor& qkv, int64_t heads, bool causal, double scale, double dropout,
                        ops::AttentionKernel kernel) {
  CHORUS_CHECK(qkv.dim() == 3 && heads >= 1 && qkv.size(2) % (3 * heads) == 0,
               "attention: packed q, k, v must be [batch, seq, 3 x heads x head_dim] for ", heads, " heads, got ",
               qkv.describe());
  Tensor x = ops::contiguous(qkv.detach());
  auto [q, k, v] = packed_heads(x, heads);
  ops::AttentionSaved saved = ops::attention(q, k, v, causal, scale, dropout, kernel);
  Tensor out = saved.out;
  saved.out = saved.out.detach();
  // Note [One gradient for packed q, k, v]: the three gradients are written
  // into the slices of one [B, T, 3 H D] tensor (the fused kernel writes them
  // there itself), where split's backward would zero-pad each to the whole
  // width and sum the three: three fills, three copies and two adds of the
  // packed size per block.
  return record("AttentionBackward", out, {qkv}, [x, heads, saved, causal, scale](const TensorList& g) {
    Tensor dx = empty_like(x);
    auto [q, k, v] = packed_heads(x, heads);
    auto [dq, dk, dv] = packed_heads(dx, heads);
    ops::attention_backward_into(g[0], q, k, v, saved, causal, scale, dq, dk, dv);
    return TensorList{dx};
  });
}

Tensor cross_entropy_fused_mean(const Tensor& logits, const Tensor& target, int64_t valid_cols,
                                std::optional<int64_t> ignore_index, bool overwrite_logits) {
  // No target equals INT64_MIN: "no ignore index" to the kernels.
  const int64_t ignore = ignore_index.value_or(std::numeric_limits<int64_t>::min());
  const DType acc = logits.dtype() == kFloat64 ? kFloat64 : kFloat32;
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
  // Note [The classifier's gradient scaled once]: the kernel writes each
  // row's gradient already divided by the count (d mean / d loss_r), so the
  // backward only multiplies by the incoming gradient -- which is backward's
  // seed of 1 for a loss the step differentiates directly: then the kernel
  // that would scale the logits-sized gradient in place reads the 1 and
  // writes nothing (a pass over [N, V] saved: the largest activation of a
  // GPT). A graph kept for a second backward scales a copy instead.
  Tensor inv_count = ignore_index ? ops::binary(BinaryOp::Div, full({}, 1.0, {acc, logits.device()}), count)
                                  : full({}, 1.0 / static_cast<double>(std::max<int64_t>(logits.size(0), 1)),
                                         {acc, logits.device()});
  auto [losses, dlogits] = ops::cross_entropy_fused(logits, target, valid_cols, ignore, inv_count, overwrite_logits);
  Tensor loss = ops::binary(BinaryOp::Div, ops::reduce(ReduceOp::Sum, losses, {}, false), count);
  Tensor dl = dlogits;
  return record("CrossEntropyBackward", loss, {logits}, [dl](const TensorList& g) {
    if (backward_keeps_graph()) return TensorList{ops::binary(BinaryOp::Mul, dl, ops::to_dtype(g[0], dl.dtype()))};
    ops::scale_unless_one_(dl, g[0]);
    return TensorList{dl};
  });
}

}  // namespace chorus::autograd
