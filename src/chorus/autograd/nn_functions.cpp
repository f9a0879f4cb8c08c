// Backward formulas of the neural-network ops (convolution, pooling, batch
// norm, batch norm + ReLU, cross entropy), beside the elementwise ones of
// functions.cpp: every backward node Chorus records lives in autograd/. The
// user-facing API with its argument checks and autocast rules is
// nn/functional.h, which calls these.
#include "chorus/autograd/nn_functions.h"

#include <algorithm>

#include "chorus/autograd/node.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/elementwise.h"
#include "chorus/ops/reduce.h"
#include "chorus/ops/views.h"

namespace chorus::autograd {

Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias, const ops::Conv2dParams& p) {
  Tensor y = ops::conv2d(x, weight, bias, p);
  Tensor xd = x.detach(), wd = weight.detach();
  bool nx = x.requires_grad(), nw = weight.requires_grad(), nb = bias.defined() && bias.requires_grad();
  TensorList inputs{x, weight};
  if (bias.defined()) inputs.push_back(bias);
  return record("Conv2dBackward", y, inputs, [xd, wd, p, nx, nw, nb](const TensorList& g) {
    TensorList out(nb ? 3 : 2);
    if (nx) out[0] = ops::conv2d_backward_input(g[0], xd, wd, p);
    if (nw || nb) {
      auto [dw, db] = ops::conv2d_backward_weight(g[0], xd, wd, p, nb);
      if (nw) out[1] = dw;
      if (nb) out[2] = db;
    }
    return out;
  });
}

Tensor conv2d_add(const Tensor& x, const Tensor& weight, const Tensor& residual, const ops::Conv2dParams& p) {
  Tensor y = ops::conv2d_add(x, weight, residual, p);
  Tensor xd = x.detach(), wd = weight.detach();
  bool nx = x.requires_grad(), nw = weight.requires_grad(), nr = residual.requires_grad();
  return record("Conv2dAddBackward", y, {x, weight, residual}, [xd, wd, p, nx, nw, nr](const TensorList& g) {
    TensorList out(3);
    if (nx) out[0] = ops::conv2d_backward_input(g[0], xd, wd, p);
    if (nw) out[1] = ops::conv2d_backward_weight(g[0], xd, wd, p, false).first;
    if (nr) out[2] = g[0];  // as an add's backward: the output's gradient itself
    return out;
  });
}

Tensor max_pool2d(const Tensor& x, const ops::Pool2dParams& p) {
  auto [y, idx] = ops::max_pool2d(x, p);
  Tensor xd = x.detach();
  Tensor indices = idx;
  return record("MaxPool2dBackward", y, {x}, [xd, indices, p](const TensorList& g) {
    return TensorList{ops::max_pool2d_backward(g[0], xd, indices, p)};
  });
}

Tensor avg_pool2d(const Tensor& x, const ops::Pool2dParams& p) {
  Tensor xd = x.detach();
  return record("AvgPool2dBackward", ops::avg_pool2d(x, p), {x}, [xd, p](const TensorList& g) {
    return TensorList{ops::avg_pool2d_backward(g[0], xd, p)};
  });
}

Tensor adaptive_avg_pool2d(const Tensor& x, int64_t out_h, int64_t out_w) {
  Tensor xd = x.detach();
  return record("AdaptiveAvgPool2dBackward", ops::adaptive_avg_pool2d(x, out_h, out_w), {x},
                [xd](const TensorList& g) { return TensorList{ops::adaptive_avg_pool2d_backward(g[0], xd)}; });
}

Tensor batch_norm_train(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                        const Tensor& bias, double momentum, double eps, const Tensor& num_batches_tracked) {
  auto [y, save_mean, save_invstd] =
      ops::batch_norm(x, weight, bias, running_mean, running_var, true, momentum, eps, num_batches_tracked);
  Tensor xd = x.detach();
  Tensor wd = weight.defined() ? weight.detach() : Tensor();
  TensorList inputs{x};
  if (weight.defined()) inputs.push_back(weight);
  if (bias.defined()) inputs.push_back(bias);
  bool has_w = weight.defined(), has_b = bias.defined();
  return record("BatchNormBackward", y, inputs, [xd, wd, mean = save_mean, invstd = save_invstd, has_w, has_b](const TensorList& g) {
    // Init-captures, not the bindings themselves: clang before 16 cannot capture those.
    auto [dx, dw, db] = ops::batch_norm_backward(g[0], xd, wd, mean, invstd);
    TensorList out{dx};
    if (has_w) out.push_back(dw);
    if (has_b) out.push_back(db.defined() ? db : Tensor());
    return out;
  });
}

namespace {
// Records relu(batch_norm(x)) = y, computed with the saved statistics.
Tensor record_batch_norm_relu(const Tensor& x, const Tensor& y, const Tensor& save_mean, const Tensor& save_invstd,
                              const Tensor& weight, const Tensor& bias) {
  // The output is saved for the ReLU mask; the next layer saves it anyway.
  Tensor xd = x.detach(), yd = y.detach();
  Tensor wd = weight.defined() ? weight.detach() : Tensor();
  Tensor bd = bias.defined() ? bias.detach() : Tensor();
  TensorList inputs{x};
  if (weight.defined()) inputs.push_back(weight);
  if (bias.defined()) inputs.push_back(bias);
  bool has_w = weight.defined(), has_b = bias.defined();
  Tensor out = record("BatchNormReluBackward", y, inputs,
                      [xd, yd, wd, bd, mean = save_mean, invstd = save_invstd, has_w, has_b](const TensorList& g) {
                        // Note [Gradient addends]: x's other gradient (a residual block's identity path)
                        // is added in the backward's elementwise pass.
                        const Tensor addend = take_gradient_addend(0);
                        auto [dx, dw, db] = ops::batch_norm_relu_backward(g[0], yd, xd, wd, bd, mean, invstd, addend);
                        TensorList out{dx};
                        if (has_w) out.push_back(dw);
                        if (has_b) out.push_back(db.defined() ? db : Tensor());
                        return out;
                      });
  if (out.grad_fn()) out.grad_fn()->takes_addends = true;
  return out;
}
}  // namespace

Tensor batch_norm_relu_train(const Tensor& x, const Tensor& running_mean, const Tensor& running_var,
                             const Tensor& weight, const Tensor& bias, double momentum, double eps,
                             const Tensor& num_batches_tracked) {
  auto [y, save_mean, save_invstd] =
      ops::batch_norm_relu(x, weight, bias, running_mean, running_var, momentum, eps, num_batches_tracked);
  return record_batch_norm_relu(x, y, save_mean, save_invstd, weight, bias);
}

std::pair<Tensor, Tensor> batch_norm_relu_sum_train(const Tensor& a, const Tensor& b, const Tensor& running_mean,
                                                    const Tensor& running_var, const Tensor& weight,
                                                    const Tensor& bias, double momentum, double eps,
                                                    const Tensor& num_batches_tracked) {
  auto [s, y, save_mean, save_invstd] =
      ops::batch_norm_relu_sum(a, b, weight, bias, running_mean, running_var, momentum, eps, num_batches_tracked);
  // s as an add's output (its gradient is both addends'), then the batch norm over s.
  Tensor sum = record("AddBackward", s, {a, b}, [](const TensorList& g) { return TensorList{g[0], g[0]}; });
  return {sum, record_batch_norm_relu(sum, y, save_mean, save_invstd, weight, bias)};
}

Tensor cross_entropy_mean(const Tensor& logits, const Tensor& target, double label_smoothing) {
  auto [losses, probs] = ops::cross_entropy(logits, target, label_smoothing);
  const int64_t b = logits.size(0);
  Tensor loss = ops::reduce(ReduceOp::Mean, losses, {}, false);
  Tensor tg = target;
  DType ldt = logits.dtype();
  Tensor p = probs;
  return record("CrossEntropyBackward", loss, {logits}, [p, tg, label_smoothing, b, ldt](const TensorList& g) {
    // d(mean)/d(loss_i) = g / B for every sample.
    Tensor dl = ops::expand(ops::reshape(ops::unary(UnaryOp::MulScalar, ops::to_dtype(g[0], p.dtype()),
                                                    1.0 / static_cast<double>(std::max<int64_t>(b, 1))), {1}),
                            {b});
    return TensorList{ops::cross_entropy_backward(dl, p, tg, label_smoothing, ldt)};
  });
}

}  // namespace chorus::autograd
