#include "chorus/nn/functional.h"

#include "chorus/autograd/autocast.h"
#include "chorus/autograd/functions.h"
#include "chorus/autograd/node.h"
#include "chorus/core/error.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/elementwise.h"
#include "chorus/ops/factory.h"
#include "chorus/ops/linalg.h"
#include "chorus/ops/reduce.h"
#include "chorus/ops/views.h"

namespace chorus::nn::functional {

using autograd::record;

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  detail::check_defined(x, "linear", "input");
  detail::check_defined(weight, "linear", "weight");
  CHORUS_CHECK(weight.dim() == 2, "linear: weight must be [out, in], got ", weight.describe());
  CHORUS_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), "linear: input ", shape_str(x.sizes()),
               " has ", x.dim() ? x.size(-1) : 0, " features but weight ", shape_str(weight.sizes()), " expects ",
               weight.size(1));
  if (bias.defined())
    CHORUS_CHECK(bias.dim() == 1 && bias.size(0) == weight.size(0), "linear: bias ", bias.describe(),
                 " must be [", weight.size(0), "]");
  if (auto dt = autocast_dtype(x)) {
    Tensor y = chorus::matmul(chorus::to_dtype(x, *dt), chorus::to_dtype(weight, *dt).t());
    return bias.defined() ? chorus::add(y, chorus::to_dtype(bias, *dt)) : y;
  }
  Tensor y = chorus::matmul(x, weight.t());
  return bias.defined() ? chorus::add(y, bias) : y;
}

Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias, const Conv2dParams& p) {
  detail::check_defined(x, "conv2d", "input");
  detail::check_defined(weight, "conv2d", "weight");
  if (auto dt = autocast_dtype(x)) {
    if (x.dtype() != *dt || weight.dtype() != *dt) {
      AutocastGuard off(std::nullopt);
      return functional::conv2d(chorus::to_dtype(x, *dt), chorus::to_dtype(weight, *dt),
                    bias.defined() ? chorus::to_dtype(bias, *dt) : bias, p);
    }
  }
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

Tensor max_pool2d(const Tensor& x, const Pool2dParams& p) {
  auto [y, idx] = ops::max_pool2d(x, p);
  Tensor xd = x.detach();
  Tensor indices = idx;
  return record("MaxPool2dBackward", y, {x}, [xd, indices, p](const TensorList& g) {
    return TensorList{ops::max_pool2d_backward(g[0], xd, indices, p)};
  });
}

Tensor avg_pool2d(const Tensor& x, const Pool2dParams& p) {
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

Tensor batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                  const Tensor& bias, bool training, double momentum, double eps) {
  detail::check_defined(x, "batch_norm", "input");
  if (!training) {
    // Evaluation is an affine map per channel: express it with differentiable
    // elementwise ops so gradients (rarely needed) still flow.
    CHORUS_CHECK(running_mean.defined() && running_var.defined(), "batch_norm: evaluation mode needs running statistics");
    auto [y, sm, si] = ops::batch_norm(x, weight, bias, running_mean, running_var, false, momentum, eps);
    if (!x.requires_grad() && !(weight.defined() && weight.requires_grad()) &&
        !(bias.defined() && bias.requires_grad()))
      return y;
    Shape bshape(x.dim(), 1);
    bshape[1] = x.size(1);
    Tensor inv = ops::reshape(ops::unary(UnaryOp::Rsqrt, ops::unary(UnaryOp::AddScalar, running_var, eps)), bshape);
    Tensor xhat = chorus::mul(chorus::sub(x, ops::reshape(running_mean, bshape)), inv);
    Tensor out = weight.defined() ? chorus::mul(xhat, weight.reshape(bshape)) : xhat;
    return bias.defined() ? chorus::add(out, bias.reshape(bshape)) : out;
  }
  auto [y, save_mean, save_invstd] = ops::batch_norm(x, weight, bias, running_mean, running_var, true, momentum, eps);
  Tensor xd = x.detach();
  Tensor wd = weight.defined() ? weight.detach() : Tensor();
  TensorList inputs{x};
  if (weight.defined()) inputs.push_back(weight);
  if (bias.defined()) inputs.push_back(bias);
  bool has_w = weight.defined(), has_b = bias.defined();
  return record("BatchNormBackward", y, inputs, [xd, wd, save_mean, save_invstd, has_w, has_b](const TensorList& g) {
    auto [dx, dw, db] = ops::batch_norm_backward(g[0], xd, wd, save_mean, save_invstd);
    TensorList out{dx};
    if (has_w) out.push_back(dw);
    if (has_b) out.push_back(db.defined() ? db : Tensor());
    return out;
  });
}

Tensor batch_norm_relu(const Tensor& x, const Tensor& running_mean, const Tensor& running_var,
                       const Tensor& weight, const Tensor& bias, bool training, double momentum, double eps) {
  detail::check_defined(x, "batch_norm_relu", "input");
  if (!training) return chorus::relu(batch_norm(x, running_mean, running_var, weight, bias, false, momentum, eps));
  auto [y, save_mean, save_invstd] = ops::batch_norm_relu(x, weight, bias, running_mean, running_var, momentum, eps);
  // The output is saved for the ReLU mask; the next layer saves it anyway.
  Tensor xd = x.detach(), yd = y.detach();
  Tensor wd = weight.defined() ? weight.detach() : Tensor();
  TensorList inputs{x};
  if (weight.defined()) inputs.push_back(weight);
  if (bias.defined()) inputs.push_back(bias);
  bool has_w = weight.defined(), has_b = bias.defined();
  return record("BatchNormReluBackward", y, inputs,
                [xd, yd, wd, save_mean, save_invstd, has_w, has_b](const TensorList& g) {
                  auto [dx, dw, db] = ops::batch_norm_relu_backward(g[0], yd, xd, wd, save_mean, save_invstd);
                  TensorList out{dx};
                  if (has_w) out.push_back(dw);
                  if (has_b) out.push_back(db.defined() ? db : Tensor());
                  return out;
                });
}

Tensor dropout(const Tensor& x, double p, bool training) {
  CHORUS_CHECK(p >= 0 && p < 1, "dropout: probability must be in [0, 1), got ", p);
  if (!training || p == 0) return x;
  Tensor mask = ops::dropout_mask(x.sizes(), x.dtype(), x.device(), p);
  return chorus::mul(x, mask);
}

Tensor cross_entropy(const Tensor& logits, const Tensor& target, double label_smoothing) {
  detail::check_defined(logits, "cross_entropy", "input");
  detail::check_defined(target, "cross_entropy", "target");
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

Tensor mse_loss(const Tensor& input, const Tensor& target) {
  CHORUS_CHECK(input.sizes() == target.sizes(), "mse_loss: input ", shape_str(input.sizes()), " and target ",
               shape_str(target.sizes()), " must have the same shape");
  Tensor d = chorus::sub(input, target);
  return chorus::mean(chorus::mul(d, d));
}

}  // namespace chorus::nn::functional
