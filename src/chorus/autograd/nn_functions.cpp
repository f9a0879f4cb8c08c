// Backward formulas of the neural-network ops (convolution, pooling, batch
// norm, batch norm + ReLU, cross entropy), beside the elementwise ones of
// functions.cpp: every backward node Chorus records lives in autograd/. The
// user-facing API with its argument checks and autocast rules is
// nn/functional.h, which calls these.
#include "chorus/autograd/nn_functions.h"

#include <algorithm>
#include <optional>

#include "chorus/autograd/node.h"
#include "chorus/autograd/side_work.h"
#include "chorus/core/error.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/elementwise.h"
#include "chorus/ops/linear.h"
#include "chorus/ops/reduce.h"
#include "chorus/ops/views.h"

namespace chorus::autograd {

// Note [GELU recomputed in the backward]: the MLP's backward reads GELU's
// input (for its derivative) and its output (for the second matrix's weight
// gradient). Both are 4 C wide: half of what a GPT block keeps for its
// backward beside the other 8 C (Note [GPT activation count]). With
// recompute_gelu the node keeps the input alone and the backward applies GELU
// to it again -- one elementwise pass over 4 C a token, against a quarter of
// the block's activations -- as llm.c does by default. Its output is the same
// function of the same input, so in float32 and float64 the gradients are
// those of the kept output up to the product epilogue's rounding of GELU.
namespace {
// A parameter's gradient dtype when a product (a linear layer's, a
// convolution's) computes with a copy of it (nullopt: the copy's own, as computed).
std::optional<DType> param_grad_dtype(const Tensor& param, const Tensor& data) {
  if (!data.defined() || data.dtype() == param.dtype()) return std::nullopt;
  return param.dtype();
}
}  // namespace

Tensor mlp_gelu(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2,
                bool recompute_gelu, const TensorList& data) {
  CHORUS_CHECK(data.empty() || data.size() == 4, "mlp_gelu: expected the 16-bit copies of w1, b1, w2 and b2, got ",
               data.size(), " tensors");
  const bool copies = !data.empty();
  const Tensor& w1c = copies ? data[0] : w1;
  const Tensor& b1c = copies ? data[1] : b1;
  const Tensor& w2c = copies ? data[2] : w2;
  const Tensor& b2c = copies ? data[3] : b2;
  const int64_t c = x.size(-1), m = x.numel() / std::max<int64_t>(c, 1);
  Shape out_shape = x.sizes();
  out_shape.back() = w2.size(0);
  Tensor x2 = ops::view(ops::contiguous(x), {m, c});
  auto [y2, pre, h] = ops::mlp_gelu(x2, w1c, b1c, w2c, b2c);
  Tensor y = ops::view(y2, out_shape);
  Tensor xd = x2.detach(), w1d = w1c.detach(), w2d = w2c.detach();
  const Shape x_shape = x.sizes();
  const bool need_dx = x.requires_grad();
  const std::optional<DType> gd = copies ? param_grad_dtype(w1, w1c) : std::nullopt;
  Tensor pre_d = pre, h_d = recompute_gelu ? Tensor() : h;
  return record("MlpGeluBackward", y, {x, w1, b1, w2, b2},
                [xd, w1d, w2d, pre_d, h_d, x_shape, need_dx, gd](const TensorList& g) {
                  Tensor g2 = ops::view(ops::contiguous(g[0]), {xd.size(0), w2d.size(0)});
                  const Tensor h_now = h_d.defined() ? h_d : ops::unary(UnaryOp::GeluTanh, pre_d);
                  std::vector<Tensor> d = ops::mlp_gelu_backward(g2, xd, w1d, w2d, pre_d, h_now, need_dx, gd);
                  return TensorList{d[0].defined() ? ops::view(d[0], x_shape) : Tensor(), d[1], d[2], d[3], d[4]};
                });
}

Tensor linear_bias(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& weight_data,
                   const Tensor& bias_data) {
  const bool has_bias = bias.defined();
  CHORUS_CHECK(bias_data.defined() == (has_bias && weight_data.defined()),
               "linear_bias: the weight's and the bias's copies come together");
  const Tensor& wc = weight_data.defined() ? weight_data : weight;
  const Tensor& bc = bias_data.defined() ? bias_data : bias;
  const int64_t k = x.size(-1), m = x.numel() / std::max<int64_t>(k, 1);
  Shape out_shape = x.sizes();
  out_shape.back() = weight.size(0);
  Tensor x2 = ops::view(ops::contiguous(x), {m, k});
  Tensor y2 = chorus::detail::empty_tensor({m, weight.size(0)}, x.dtype(), x.device());
  ops::linear_bias_into(x2, wc, bc, y2);
  Tensor y = ops::view(y2, out_shape);
  Tensor xd = x2.detach(), wd = wc.detach();
  const Shape x_shape = x.sizes();
  const bool need_dx = x.requires_grad();
  const std::optional<DType> gd = param_grad_dtype(weight, weight_data);
  TensorList inputs{x, weight};
  if (has_bias) inputs.push_back(bias);
  return record("LinearBackward", y, inputs, [xd, wd, x_shape, need_dx, gd, has_bias](const TensorList& g) {
    Tensor g2 = ops::view(ops::contiguous(g[0]), {xd.size(0), wd.size(0)});
    auto [dx, dw, db] = ops::linear_bias_backward(g2, xd, wd, need_dx, has_bias, gd);
    TensorList out{dx.defined() ? ops::view(dx, x_shape) : Tensor(), dw};
    if (has_bias) out.push_back(db);
    return out;
  });
}

namespace {

// A convolution's backward: dx (if nx) on the current stream; dw and db (if
// nw, nb) beside it where the device allows (Note [Weight gradients beside
// the data gradient]: whatever reads them joins first), else on it too.
TensorList conv_backward(const Tensor& dy, const Tensor& xd, const Tensor& wd, const ops::Conv2dParams& p, bool nx,
                         bool nw, bool nb, std::optional<DType> dw_dtype, size_t n_out) {
  TensorList out(n_out);
  auto data_grad = [&] {
    if (nx) out[0] = ops::conv2d_backward_input(dy, xd, wd, p);
  };
  auto weight_grads = [&] {
    TensorList w(2);
    if (nw || nb) {
      auto [dw, db] = ops::conv2d_backward_weight(dy, xd, wd, p, nb, dw_dtype);
      if (nw) w[0] = dw;
      if (nb) w[1] = db;
    }
    return w;
  };
  TensorList w;
  if ((nw || nb) && beside_allowed(dy.device())) {
    w = run_beside(dy.device(), {dy, xd, wd}, data_grad, weight_grads);
  } else {
    data_grad();
    w = weight_grads();
  }
  if (nw) out[1] = w[0];
  if (nb && n_out > 2) out[2] = w[1];
  return out;
}
}  // namespace

Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias, const ops::Conv2dParams& p,
              const Tensor& weight_data) {
  const Tensor& wc = weight_data.defined() ? weight_data : weight;
  Tensor y = ops::conv2d(x, wc, bias, p);
  Tensor xd = x.detach(), wd = wc.detach();
  const std::optional<DType> dw_dtype = param_grad_dtype(weight, weight_data);
  bool nx = x.requires_grad(), nw = weight.requires_grad(), nb = bias.defined() && bias.requires_grad();
  TensorList inputs{x, weight};
  if (bias.defined()) inputs.push_back(bias);
  return record("Conv2dBackward", y, inputs, [xd, wd, p, nx, nw, nb, dw_dtype](const TensorList& g) {
    return conv_backward(g[0], xd, wd, p, nx, nw, nb, dw_dtype, nb ? 3 : 2);
  });
}

Tensor conv2d_add(const Tensor& x, const Tensor& weight, const Tensor& residual, const ops::Conv2dParams& p,
                  const Tensor& weight_data) {
  const Tensor& wc = weight_data.defined() ? weight_data : weight;
  Tensor y = ops::conv2d_add(x, wc, residual, p);
  Tensor xd = x.detach(), wd = wc.detach();
  const std::optional<DType> dw_dtype = param_grad_dtype(weight, weight_data);
  bool nx = x.requires_grad(), nw = weight.requires_grad(), nr = residual.requires_grad();
  return record("Conv2dAddBackward", y, {x, weight, residual}, [xd, wd, p, nx, nw, nr, dw_dtype](const TensorList& g) {
    TensorList out = conv_backward(g[0], xd, wd, p, nx, nw, false, dw_dtype, 3);
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
