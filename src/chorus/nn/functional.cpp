#include "chorus/nn/functional.h"

#include "chorus/autograd/autocast.h"
#include "chorus/autograd/functions.h"
#include "chorus/autograd/grad_mode.h"
#include "chorus/autograd/nn_functions.h"
#include "chorus/core/error.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/elementwise.h"
#include "chorus/ops/factory.h"
#include "chorus/ops/linalg.h"
#include "chorus/ops/reduce.h"
#include "chorus/ops/views.h"

namespace chorus::nn::functional {

namespace {
// Under autocast, the 16-bit copy a float32 CUDA parameter's product computes
// with while the op records the parameter itself, so its gradient comes out of
// the product in float32 (Note [Float filter gradients from 16-bit data] in
// cuda/conv/conv.cpp, Note [Float weight gradients from 16-bit products] in
// cuda/blas/gemm.cpp); undefined for other parameters, which keep the
// recorded cast.
Tensor float_weight_data(const Tensor& weight, DType dt) {
  if (!weight.defined() || weight.dtype() != kFloat32 || !weight.device().is_cuda()) return Tensor();
  return autocast_weight_data(weight, dt);
}
}  // namespace

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
  // With a bias, one op whose products carry it (Note [Linear layers'
  // epilogues] in cuda/blas/gemm.cpp); without, a matmul -- but for a float32
  // weight under autocast (a tied classifier's projection), which takes the
  // same op for its float32 gradient.
  auto fused = [](const Tensor& xx, const Tensor& w, const Tensor& b) {
    return xx.dim() >= 2 && xx.numel() > 0 && xx.dtype() == w.dtype() && xx.device() == w.device() &&
           (!b.defined() || (xx.dtype() == b.dtype() && xx.device() == b.device()));
  };
  if (auto dt = autocast_dtype(x)) {  // weights: Note [Autocast weight copies]
    Tensor xx = chorus::to_dtype(x, *dt);
    if (const Tensor wd = float_weight_data(weight, *dt); wd.defined()) {
      const Tensor bd = float_weight_data(bias, *dt);
      if (bd.defined() == bias.defined() && fused(xx, wd, bd)) return autograd::linear_bias(xx, weight, bias, wd, bd);
    }
    Tensor w = autocast_weight(weight, *dt);
    if (bias.defined()) {
      Tensor b = autocast_weight(bias, *dt);
      if (fused(xx, w, b)) return autograd::linear_bias(xx, w, b);
      return chorus::add(chorus::matmul(xx, w.t()), b);
    }
    return chorus::matmul(xx, w.t());
  }
  if (bias.defined() && fused(x, weight, bias)) return autograd::linear_bias(x, weight, bias);
  Tensor y = chorus::matmul(x, weight.t());
  return bias.defined() ? chorus::add(y, bias) : y;
}

Tensor mlp_gelu(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2,
               bool recompute_gelu) {
  for (const Tensor* t : {&x, &w1, &b1, &w2, &b2}) detail::check_defined(*t, "mlp_gelu", "an operand");
  CHORUS_CHECK(w1.dim() == 2 && w2.dim() == 2 && x.dim() >= 2 && x.size(-1) == w1.size(1) &&
                   w2.size(1) == w1.size(0) && b1.dim() == 1 && b1.size(0) == w1.size(0) && b2.dim() == 1 &&
                   b2.size(0) == w2.size(0),
               "mlp_gelu: x ", x.describe(), ", w1 ", w1.describe(), ", b1 ", b1.describe(), ", w2 ", w2.describe(),
               ", b2 ", b2.describe(), " do not fit");
  Tensor xx = x, a = w1, ab = b1, c = w2, cb = b2;
  if (auto dt = autocast_dtype(x)) {  // Note [Autocast weight copies]
    xx = chorus::to_dtype(x, *dt);
    TensorList data;
    for (const Tensor* p : {&w1, &b1, &w2, &b2}) data.push_back(float_weight_data(*p, *dt));
    bool copies = xx.numel() > 0;
    for (const Tensor& d : data) copies = copies && d.defined() && d.device() == xx.device();
    if (copies) return autograd::mlp_gelu(xx, w1, b1, w2, b2, recompute_gelu, data);
    a = autocast_weight(w1, *dt);
    ab = autocast_weight(b1, *dt);
    c = autocast_weight(w2, *dt);
    cb = autocast_weight(b2, *dt);
  }
  bool one = xx.numel() > 0;
  for (const Tensor* t : {&a, &ab, &c, &cb}) one = one && t->dtype() == xx.dtype() && t->device() == xx.device();
  if (one) return autograd::mlp_gelu(xx, a, ab, c, cb, recompute_gelu);
  // (The composition keeps GELU's output: recompute_gelu applies to the fused op.)
  return linear(gelu(linear(x, w1, b1), /*tanh_approximation=*/true), w2, b2);
}

namespace {

// conv2d_add_unsummed once x, the weight's data and the residual share a dtype
// and device.
std::pair<Tensor, Tensor> add_unsummed(const Tensor& x, const Tensor& weight, const Tensor& weight_data,
                                       const Tensor& residual, const Conv2dParams& p) {
  const Tensor& wc = weight_data.defined() ? weight_data : weight;
  if (ops::conv2d_add_defers(x.detach(), wc.detach(), residual.detach(), p))
    return {autograd::conv2d(x, weight, Tensor(), p, weight_data), residual};
  return {autograd::conv2d_add(x, weight, residual, p, weight_data), Tensor()};
}
}  // namespace

Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias, const Conv2dParams& p) {
  detail::check_defined(x, "conv2d", "input");
  detail::check_defined(weight, "conv2d", "weight");
  if (auto dt = autocast_dtype(x)) {
    if (x.dtype() != *dt || weight.dtype() != *dt) {
      AutocastGuard off(std::nullopt);
      // Weights: Note [Autocast weight copies].
      const Tensor xc = chorus::to_dtype(x, *dt), bc = bias.defined() ? autocast_weight(bias, *dt) : bias;
      if (const Tensor wd = float_weight_data(weight, *dt); wd.defined()) return autograd::conv2d(xc, weight, bc, p, wd);
      return functional::conv2d(xc, autocast_weight(weight, *dt), bc, p);
    }
  }
  return autograd::conv2d(x, weight, bias, p);
}

Tensor conv2d_add(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& residual,
                  const Conv2dParams& p) {
  detail::check_defined(x, "conv2d_add", "input");
  detail::check_defined(weight, "conv2d_add", "weight");
  detail::check_defined(residual, "conv2d_add", "residual");
  if (auto dt = autocast_dtype(x)) {
    // A residual wider than the autocast dtype stays as wide, as add() keeps
    // it outside autocast: the convolution, then the add promotes.
    if (dtype_size(residual.dtype()) > dtype_size(*dt)) return chorus::add(functional::conv2d(x, weight, bias, p), residual);
    if (!bias.defined() && (x.dtype() != *dt || weight.dtype() != *dt || residual.dtype() != *dt)) {
      AutocastGuard off(std::nullopt);
      // Weights: Note [Autocast weight copies].
      const Tensor xc = chorus::to_dtype(x, *dt), rc = chorus::to_dtype(residual, *dt);
      if (const Tensor wd = float_weight_data(weight, *dt); wd.defined() && rc.device() == xc.device())
        return autograd::conv2d_add(xc, weight, rc, p, wd);
      return functional::conv2d_add(xc, autocast_weight(weight, *dt), bias, rc, p);
    }
  }
  if (bias.defined() || residual.dtype() != x.dtype() || weight.dtype() != x.dtype() ||
      residual.device() != x.device())
    return chorus::add(functional::conv2d(x, weight, bias, p), residual);
  return autograd::conv2d_add(x, weight, residual, p);
}

std::pair<Tensor, Tensor> conv2d_add_unsummed(const Tensor& x, const Tensor& weight, const Tensor& residual,
                                              const Conv2dParams& p) {
  detail::check_defined(x, "conv2d_add_unsummed", "input");
  detail::check_defined(weight, "conv2d_add_unsummed", "weight");
  detail::check_defined(residual, "conv2d_add_unsummed", "residual");
  if (auto dt = autocast_dtype(x)) {
    if (dtype_size(residual.dtype()) > dtype_size(*dt)) return {functional::conv2d_add(x, weight, Tensor(), residual, p), Tensor()};
    if (x.dtype() != *dt || weight.dtype() != *dt || residual.dtype() != *dt) {
      AutocastGuard off(std::nullopt);
      // Weights: Note [Autocast weight copies].
      const Tensor xc = chorus::to_dtype(x, *dt), rc = chorus::to_dtype(residual, *dt);
      if (const Tensor wd = float_weight_data(weight, *dt); wd.defined() && rc.device() == xc.device())
        return add_unsummed(xc, weight, wd, rc, p);
      return functional::conv2d_add_unsummed(xc, autocast_weight(weight, *dt), rc, p);
    }
  }
  if (residual.dtype() != x.dtype() || weight.dtype() != x.dtype() || residual.device() != x.device())
    return {functional::conv2d_add(x, weight, Tensor(), residual, p), Tensor()};
  return add_unsummed(x, weight, Tensor(), residual, p);
}

Tensor max_pool2d(const Tensor& x, const Pool2dParams& p) { return autograd::max_pool2d(x, p); }

Tensor avg_pool2d(const Tensor& x, const Pool2dParams& p) { return autograd::avg_pool2d(x, p); }

Tensor adaptive_avg_pool2d(const Tensor& x, int64_t out_h, int64_t out_w) {
  return autograd::adaptive_avg_pool2d(x, out_h, out_w);
}

Tensor batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                  const Tensor& bias, bool training, double momentum, double eps,
                  const Tensor& num_batches_tracked) {
  detail::check_defined(x, "batch_norm", "input");
  if (!training) {
    // Evaluation is an affine map per channel: express it with differentiable
    // elementwise ops so gradients (rarely needed) still flow.
    CHORUS_CHECK(running_mean.defined() && running_var.defined(), "batch_norm: evaluation mode needs running statistics");
    // The fused kernel when nothing records a graph (evaluation under
    // NoGradGuard: the parameters still require grad, the graph is off).
    const bool records = grad_enabled() && (x.requires_grad() || (weight.defined() && weight.requires_grad()) ||
                                            (bias.defined() && bias.requires_grad()));
    if (!records) return std::get<0>(ops::batch_norm(x, weight, bias, running_mean, running_var, false, momentum, eps));
    Shape bshape(x.dim(), 1);
    bshape[1] = x.size(1);
    Tensor inv = ops::reshape(ops::unary(UnaryOp::Rsqrt, ops::unary(UnaryOp::AddScalar, running_var, eps)), bshape);
    Tensor xhat = chorus::mul(chorus::sub(x, ops::reshape(running_mean, bshape)), inv);
    Tensor out = weight.defined() ? chorus::mul(xhat, weight.reshape(bshape)) : xhat;
    return bias.defined() ? chorus::add(out, bias.reshape(bshape)) : out;
  }
  return autograd::batch_norm_train(x, running_mean, running_var, weight, bias, momentum, eps, num_batches_tracked);
}

Tensor batch_norm_relu(const Tensor& x, const Tensor& running_mean, const Tensor& running_var,
                       const Tensor& weight, const Tensor& bias, bool training, double momentum, double eps,
                       const Tensor& num_batches_tracked) {
  detail::check_defined(x, "batch_norm_relu", "input");
  if (!training) return chorus::relu(batch_norm(x, running_mean, running_var, weight, bias, false, momentum, eps));
  return autograd::batch_norm_relu_train(x, running_mean, running_var, weight, bias, momentum, eps,
                                         num_batches_tracked);
}

std::pair<Tensor, Tensor> batch_norm_relu_sum(const Tensor& a, const Tensor& b, const Tensor& running_mean,
                                              const Tensor& running_var, const Tensor& weight, const Tensor& bias,
                                              bool training, double momentum, double eps,
                                              const Tensor& num_batches_tracked) {
  detail::check_defined(a, "batch_norm_relu_sum", "a");
  const bool fusable = b.defined() && training && b.sizes() == a.sizes() && b.dtype() == a.dtype() &&
                       b.device() == a.device();
  if (!fusable) {
    const Tensor s = b.defined() ? chorus::add(a, b) : a;
    return {s, batch_norm_relu(s, running_mean, running_var, weight, bias, training, momentum, eps,
                               num_batches_tracked)};
  }
  return autograd::batch_norm_relu_sum_train(a, b, running_mean, running_var, weight, bias, momentum, eps,
                                             num_batches_tracked);
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
  return autograd::cross_entropy_mean(logits, target, label_smoothing);
}

Tensor mse_loss(const Tensor& input, const Tensor& target) {
  CHORUS_CHECK(input.sizes() == target.sizes(), "mse_loss: input ", shape_str(input.sizes()), " and target ",
               shape_str(target.sizes()), " must have the same shape");
  Tensor d = chorus::sub(input, target);
  return chorus::mean(chorus::mul(d, d));
}

}  // namespace chorus::nn::functional
