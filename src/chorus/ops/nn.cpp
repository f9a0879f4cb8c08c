#include "chorus/ops/nn.h"

#include "chorus/core/error.h"
#include "chorus/core/graph_capture.h"
#include "chorus/core/rng.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/dispatch.h"

namespace chorus::ops {

namespace {
// Memory layout policy: CPU kernels take NCHW-contiguous tensors. CUDA kernels
// read the layout from the strides; a channels-last input gives channels-last
// outputs so that a network converted once stays NHWC throughout.
Tensor prepare(const Tensor& t, Device dev) {
  Tensor d = operand_to_device(t, dev);
  if (dev.is_cuda() && is_channels_last(d)) return d;
  return contiguous(d);
}
bool cl(const Tensor& t) { return t.device().is_cuda() && is_channels_last(t); }
// A gradient moved to `dev` in the layout of the forward input it belongs to.
// Backward ops follow the forward input's layout, never the incoming
// gradient's: a [N,C,1,1] gradient from a global pool is NCHW-contiguous, and
// following it would run a whole channels-last backward pass in NCHW.
Tensor grad_in_layout(const Tensor& dy, Device dev, bool channels_last) {
  Tensor d = to_device(dy, dev);
  if (channels_last && dev.is_cuda()) return to_channels_last(d);
  return contiguous(d);
}
}  // namespace

Conv2dGeometry conv2d_geometry(const Tensor& x, const Tensor& w, const Conv2dParams& p) {
  CHORUS_CHECK(x.dim() == 4, "conv2d: expected input [N, C, H, W], got ", x.describe());
  CHORUS_CHECK(w.dim() == 4, "conv2d: expected weight [C_out, C_in/groups, kH, kW], got ", w.describe());
  CHORUS_CHECK(p.groups >= 1 && x.size(1) % p.groups == 0 && w.size(0) % p.groups == 0,
               "conv2d: groups=", p.groups, " must divide input channels ", x.size(1),
               " and output channels ", w.size(0));
  CHORUS_CHECK(w.size(1) * p.groups == x.size(1), "conv2d: input ", shape_str(x.sizes()), " has ",
               x.size(1), " channels but weight ", shape_str(w.sizes()), " expects ",
               w.size(1) * p.groups, " (groups=", p.groups, ")");
  CHORUS_CHECK(p.stride_h > 0 && p.stride_w > 0 && p.dil_h > 0 && p.dil_w > 0 && p.pad_h >= 0 && p.pad_w >= 0,
               "conv2d: stride and dilation must be positive and padding non-negative");
  Conv2dGeometry g{x.size(0), x.size(1), x.size(2), x.size(3), w.size(0), w.size(2), w.size(3),
                   p.stride_h, p.stride_w, p.pad_h, p.pad_w, p.dil_h, p.dil_w, p.groups};
  CHORUS_CHECK(g.out_h() > 0 && g.out_w() > 0, "conv2d: input ", shape_str(x.sizes()),
               " is too small for kernel ", w.size(2), "x", w.size(3), " with padding ", p.pad_h,
               ",", p.pad_w, " and dilation ", p.dil_h, ",", p.dil_w);
  return g;
}

Tensor conv2d(const Tensor& x, const Tensor& w, const Tensor& bias, const Conv2dParams& p) {
  detail::check_defined(x, "conv2d", "input");
  detail::check_defined(w, "conv2d", "weight");
  Conv2dGeometry g = conv2d_geometry(x, w, p);
  Device dev = x.device();
  Tensor xx = prepare(x, dev), ww = prepare(w, dev), bb;
  if (bias.defined()) {
    CHORUS_CHECK(bias.dim() == 1 && bias.size(0) == g.c_out, "conv2d: bias ", bias.describe(),
                 " must be [", g.c_out, "]");
    bb = prepare(bias, dev);
  }
  Tensor y = empty_with_layout({g.n, g.c_out, g.out_h(), g.out_w()}, x.dtype(), dev, cl(xx));
  CHORUS_KERNEL(dev, conv2d_forward, g, xx, ww, bb, y);
  return y;
}

Tensor conv2d_add(const Tensor& x, const Tensor& w, const Tensor& residual, const Conv2dParams& p) {
  detail::check_defined(x, "conv2d_add", "input");
  detail::check_defined(w, "conv2d_add", "weight");
  detail::check_defined(residual, "conv2d_add", "residual");
  Conv2dGeometry g = conv2d_geometry(x, w, p);
  const Shape ys{g.n, g.c_out, g.out_h(), g.out_w()};
  CHORUS_CHECK(residual.sizes() == ys, "conv2d_add: residual ", residual.describe(), " must have the output's shape ",
               shape_str(ys));
  CHORUS_CHECK(residual.dtype() == x.dtype(), "conv2d_add: residual ", residual.describe(), " must have the input's dtype ",
               dtype_name(x.dtype()));
  Device dev = x.device();
  Tensor xx = prepare(x, dev), ww = prepare(w, dev);
  // The residual in the output's layout (a copy only when it is not).
  Tensor rr = grad_in_layout(residual, dev, cl(xx));
  Tensor y = empty_with_layout(ys, x.dtype(), dev, cl(xx));
  CHORUS_KERNEL(dev, conv2d_forward_add, g, xx, ww, rr, y);
  return y;
}

bool conv2d_add_defers(const Tensor& x, const Tensor& w, const Tensor& residual, const Conv2dParams& p) {
  const Conv2dGeometry g = conv2d_geometry(x, w, p);
  if (residual.sizes() != Shape{g.n, g.c_out, g.out_h(), g.out_w()} || residual.dtype() != x.dtype() ||
      w.dtype() != x.dtype() || residual.device() != x.device() || w.device() != x.device())
    return true;  // conv2d_add would not fuse these either
  const Device dev = x.device();
  Tensor xx = prepare(x, dev);
  return CHORUS_KERNEL(dev, conv2d_add_defers, g, xx, prepare(w, dev), grad_in_layout(residual, dev, cl(xx)));
}

Tensor conv2d_backward_input(const Tensor& dy, const Tensor& x, const Tensor& w, const Conv2dParams& p) {
  Conv2dGeometry g = conv2d_geometry(x, w, p);
  Device dev = dy.device();
  const bool want_cl = cl(x);
  Tensor ddy = grad_in_layout(dy, dev, want_cl), ww = prepare(w, dev);
  Tensor dx = empty_with_layout(x.sizes(), x.dtype(), dev, want_cl);
  CHORUS_KERNEL(dev, conv2d_backward_input, g, ddy, ww, dx);
  return dx;
}

std::pair<Tensor, Tensor> conv2d_backward_weight(const Tensor& dy, const Tensor& x, const Tensor& w,
                                                 const Conv2dParams& p, bool with_bias,
                                                 std::optional<DType> dw_dtype) {
  Conv2dGeometry g = conv2d_geometry(x, w, p);
  Device dev = dy.device();
  Tensor xx = prepare(x, dev);
  Tensor ddy = grad_in_layout(dy, dev, cl(xx));
  Tensor dw = empty_with_layout(w.sizes(), dw_dtype.value_or(w.dtype()), dev, cl(w));
  Tensor db = with_bias ? detail::empty_tensor({g.c_out}, w.dtype(), dev) : Tensor();
  CHORUS_KERNEL(dev, conv2d_backward_weight, g, ddy, xx, dw, db);
  return {dw, db};
}

Pool2dGeometry pool2d_geometry(const Tensor& x, const Pool2dParams& p, const char* op) {
  CHORUS_CHECK(x.dim() == 4, op, ": expected input [N, C, H, W], got ", x.describe());
  CHORUS_CHECK(p.kh > 0 && p.kw > 0 && p.stride_h > 0 && p.stride_w > 0, op,
               ": kernel size and stride must be positive");
  CHORUS_CHECK(p.pad_h >= 0 && 2 * p.pad_h <= p.kh && p.pad_w >= 0 && 2 * p.pad_w <= p.kw, op,
               ": padding must be at most half the kernel size");
  Pool2dGeometry g{x.size(0), x.size(1), x.size(2), x.size(3), p.kh, p.kw,
                   p.stride_h, p.stride_w, p.pad_h, p.pad_w};
  CHORUS_CHECK(g.out_h() > 0 && g.out_w() > 0, op, ": input ", shape_str(x.sizes()),
               " is smaller than the ", p.kh, "x", p.kw, " window");
  return g;
}

std::pair<Tensor, Tensor> max_pool2d(const Tensor& x, const Pool2dParams& p) {
  Pool2dGeometry g = pool2d_geometry(x, p, "max_pool2d");
  Device dev = x.device();
  Tensor xx = prepare(x, dev);
  Tensor y = empty_with_layout({g.n, g.c, g.out_h(), g.out_w()}, x.dtype(), dev, cl(xx));
  Tensor idx = empty_with_layout(y.sizes(), kInt64, dev, cl(xx));
  CHORUS_KERNEL(dev, max_pool2d_forward, g, xx, y, idx);
  return {y, idx};
}

Tensor max_pool2d_backward(const Tensor& dy, const Tensor& x, const Tensor& indices, const Pool2dParams& p) {
  Pool2dGeometry g = pool2d_geometry(x, p, "max_pool2d");
  Device dev = dy.device();
  Tensor ddy = grad_in_layout(dy, dev, cl(indices));
  Tensor dx = empty_with_layout(x.sizes(), x.dtype(), dev, cl(indices));
  CHORUS_KERNEL(dev, max_pool2d_backward, g, ddy, indices, dx);
  return dx;
}

Tensor avg_pool2d(const Tensor& x, const Pool2dParams& p) {
  Pool2dGeometry g = pool2d_geometry(x, p, "avg_pool2d");
  Device dev = x.device();
  Tensor xx = prepare(x, dev);
  Tensor y = empty_with_layout({g.n, g.c, g.out_h(), g.out_w()}, x.dtype(), dev, cl(xx));
  CHORUS_KERNEL(dev, avg_pool2d_forward, g, xx, y);
  return y;
}

Tensor avg_pool2d_backward(const Tensor& dy, const Tensor& x, const Pool2dParams& p) {
  Pool2dGeometry g = pool2d_geometry(x, p, "avg_pool2d");
  Device dev = dy.device();
  Tensor ddy = grad_in_layout(dy, dev, cl(x));
  Tensor dx = empty_with_layout(x.sizes(), x.dtype(), dev, cl(x));
  CHORUS_KERNEL(dev, avg_pool2d_backward, g, ddy, dx);
  return dx;
}

Tensor adaptive_avg_pool2d(const Tensor& x, int64_t out_h, int64_t out_w) {
  CHORUS_CHECK(x.dim() == 4, "adaptive_avg_pool2d: expected input [N, C, H, W], got ", x.describe());
  CHORUS_CHECK(out_h > 0 && out_w > 0, "adaptive_avg_pool2d: output size must be positive, got ",
               out_h, "x", out_w);
  Device dev = x.device();
  Tensor xx = prepare(x, dev);
  Tensor y = empty_with_layout({x.size(0), x.size(1), out_h, out_w}, x.dtype(), dev, cl(xx));
  CHORUS_KERNEL(dev, adaptive_avg_pool2d_forward, xx, y);
  return y;
}

Tensor adaptive_avg_pool2d_backward(const Tensor& dy, const Tensor& x) {
  Device dev = dy.device();
  Tensor ddy = grad_in_layout(dy, dev, cl(x));
  Tensor dx = empty_with_layout(x.sizes(), x.dtype(), dev, cl(x));
  CHORUS_KERNEL(dev, adaptive_avg_pool2d_backward, ddy, dx);
  return dx;
}

namespace {
// (x or x + addend, y, save_mean, save_invstd); with an addend (training, relu)
// the batch norm runs over the sum, which the kernel writes (Note [Residual
// add left to the batch norm] in ops/nn.h).
std::tuple<Tensor, Tensor, Tensor, Tensor> batch_norm_impl(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                                           const Tensor& running_mean, const Tensor& running_var,
                                                           bool training, double momentum, double eps, bool relu,
                                                           const Tensor& num_batches_tracked,
                                                           const Tensor& addend = Tensor()) {
  CHORUS_CHECK(x.dim() == 2 || x.dim() == 4, "batch_norm: expected input [N, C] or [N, C, H, W], got ",
               x.describe());
  const int64_t c = x.size(1);
  auto check_c = [&](const Tensor& t, const char* name) {
    if (t.defined())
      CHORUS_CHECK(t.dim() == 1 && t.size(0) == c, "batch_norm: ", name, " ", t.describe(),
                   " must be [", c, "] for input ", shape_str(x.sizes()));
  };
  check_c(gamma, "weight");
  check_c(beta, "bias");
  check_c(running_mean, "running_mean");
  check_c(running_var, "running_var");
  CHORUS_CHECK(training || (running_mean.defined() && running_var.defined()),
               "batch_norm: evaluation mode needs running statistics");
  if (training) {
    int64_t per_channel = x.numel() / std::max<int64_t>(c, 1);
    CHORUS_CHECK(per_channel > 1, "batch_norm: training needs more than one value per channel, got input ",
                 shape_str(x.sizes()));
  }
  Device dev = x.device();
  Tensor xx = prepare(x, dev);
  Tensor y = empty_with_layout(x.sizes(), x.dtype(), dev, cl(xx));
  // Saved statistics are float32 (enough for float32/bf16/f16 inputs), float64 for a float64 input
  // so that a float64 forward and backward stay exact (gradient checks).
  const DType stat_dtype = x.dtype() == kFloat64 ? kFloat64 : kFloat32;
  Tensor sm = detail::empty_tensor({c}, stat_dtype, dev), si = detail::empty_tensor({c}, stat_dtype, dev);
  Tensor g = gamma.defined() ? prepare(gamma, dev) : Tensor();
  Tensor b = beta.defined() ? prepare(beta, dev) : Tensor();
  const Tensor counter = training ? num_batches_tracked : Tensor();
  Tensor sum = xx;
  if (addend.defined()) {
    sum = empty_with_layout(x.sizes(), x.dtype(), dev, cl(xx));
    CHORUS_KERNEL(dev, batch_norm_relu_sum_forward, xx, grad_in_layout(addend, dev, cl(xx)), sum, g, b,
                  running_mean, running_var, momentum, eps, y, sm, si, counter);
  } else if (relu) {
    CHORUS_KERNEL(dev, batch_norm_relu_forward, xx, g, b, running_mean, running_var, momentum, eps, y, sm, si,
                  counter);
  } else {
    CHORUS_KERNEL(dev, batch_norm_forward, xx, g, b, running_mean, running_var, training, momentum, eps,
                  y, sm, si, counter);
  }
  if (training && running_mean.defined()) {
    running_mean.bump_version();
    running_var.bump_version();
  }
  if (counter.defined()) counter.bump_version();
  return {sum, y, sm, si};
}

std::tuple<Tensor, Tensor, Tensor> batch_norm_backward_impl(const Tensor& dy, const Tensor& y, const Tensor& x,
                                                            const Tensor& gamma, const Tensor& beta,
                                                            const Tensor& save_mean, const Tensor& save_invstd,
                                                            const Tensor& dx_addend) {
  Device dev = x.device();
  Tensor xx = prepare(x, dev);
  Tensor ddy = grad_in_layout(dy, dev, cl(xx));
  Tensor dx = empty_with_layout(x.sizes(), x.dtype(), dev, cl(xx));
  const int64_t c = x.size(1);
  Tensor dg = gamma.defined() ? detail::empty_tensor({c}, gamma.dtype(), dev) : Tensor();
  Tensor db = gamma.defined() ? detail::empty_tensor({c}, gamma.dtype(), dev) : Tensor();
  if (y.defined()) {
    Tensor yy = grad_in_layout(y, dev, cl(xx));
    Tensor add = dx_addend.defined() ? to_dtype(grad_in_layout(dx_addend, dev, cl(xx)), x.dtype()) : Tensor();
    CHORUS_KERNEL(dev, batch_norm_relu_backward, ddy, yy, xx, gamma, beta, save_mean, save_invstd, dx, dg, db, add);
  } else {
    CHORUS_KERNEL(dev, batch_norm_backward, ddy, xx, gamma, save_mean, save_invstd, dx, dg, db);
  }
  return {dx, dg, db};
}
}  // namespace

std::tuple<Tensor, Tensor, Tensor> batch_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                              const Tensor& running_mean, const Tensor& running_var,
                                              bool training, double momentum, double eps,
                                              const Tensor& num_batches_tracked) {
  auto [s, y, sm, si] = batch_norm_impl(x, gamma, beta, running_mean, running_var, training, momentum, eps, false,
                                        num_batches_tracked);
  return {y, sm, si};
}

std::tuple<Tensor, Tensor, Tensor> batch_norm_relu(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                                   const Tensor& running_mean, const Tensor& running_var,
                                                   double momentum, double eps,
                                                   const Tensor& num_batches_tracked) {
  auto [s, y, sm, si] = batch_norm_impl(x, gamma, beta, running_mean, running_var, true, momentum, eps, true,
                                        num_batches_tracked);
  return {y, sm, si};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> batch_norm_relu_sum(const Tensor& a, const Tensor& b, const Tensor& gamma,
                                                               const Tensor& beta, const Tensor& running_mean,
                                                               const Tensor& running_var, double momentum,
                                                               double eps, const Tensor& num_batches_tracked) {
  detail::check_defined(a, "batch_norm_relu_sum", "a");
  detail::check_defined(b, "batch_norm_relu_sum", "b");
  CHORUS_CHECK(a.sizes() == b.sizes() && a.dtype() == b.dtype() && a.device() == b.device(),
               "batch_norm_relu_sum: the addends ", a.describe(), " and ", b.describe(),
               " must share shape, dtype and device");
  return batch_norm_impl(a, gamma, beta, running_mean, running_var, true, momentum, eps, true, num_batches_tracked,
                         b);
}

std::tuple<Tensor, Tensor, Tensor> batch_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                                       const Tensor& save_mean, const Tensor& save_invstd) {
  return batch_norm_backward_impl(dy, Tensor(), x, gamma, Tensor(), save_mean, save_invstd, Tensor());
}

std::tuple<Tensor, Tensor, Tensor> batch_norm_relu_backward(const Tensor& dy, const Tensor& y, const Tensor& x,
                                                            const Tensor& gamma, const Tensor& beta,
                                                            const Tensor& save_mean, const Tensor& save_invstd,
                                                            const Tensor& dx_addend) {
  CHORUS_CHECK(y.sizes() == x.sizes(), "batch_norm_relu_backward: y ", y.describe(), " must match x ", x.describe());
  if (dx_addend.defined())
    CHORUS_CHECK(dx_addend.sizes() == x.sizes(), "batch_norm_relu_backward: dx_addend ", dx_addend.describe(),
                 " must match x ", x.describe());
  return batch_norm_backward_impl(dy, y, x, gamma, beta, save_mean, save_invstd, dx_addend);
}

namespace {
// Softmax kernels work on [rows, cols] over the last dim; other dims are moved last.
Tensor rows_view(const Tensor& t, int64_t dim, Shape* perm_out) {
  int64_t nd = t.dim();
  Shape perm;
  for (int64_t i = 0; i < nd; ++i)
    if (i != dim) perm.push_back(i);
  perm.push_back(dim);
  *perm_out = perm;
  Shape sizes, strides;
  for (int64_t p : perm) {
    sizes.push_back(t.size(p));
    strides.push_back(t.stride(p));
  }
  return contiguous(detail::make_view(t, sizes, strides, t.storage_offset()));
}
Tensor unpermute(const Tensor& t, const Shape& perm) {
  // t is contiguous in permuted order; view it back in original dim order.
  Shape sizes(perm.size()), strides(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) {
    sizes[perm[i]] = t.size(static_cast<int64_t>(i));
    strides[perm[i]] = t.stride(static_cast<int64_t>(i));
  }
  return detail::make_view(t, sizes, strides, 0);
}
}  // namespace

Tensor softmax(const Tensor& x, int64_t dim, bool log) {
  CHORUS_CHECK(is_floating(x.dtype()), log ? "log_softmax" : "softmax", ": expected a floating tensor, got ",
               x.describe());
  if (x.dim() == 0) return softmax(detail::make_view(x, {1}, {1}, x.storage_offset()), 0, log);
  dim = wrap_dim(dim, x.dim(), log ? "log_softmax" : "softmax");
  Shape perm;
  Tensor r = rows_view(x, dim, &perm);
  Tensor y = detail::empty_tensor(r.sizes(), x.dtype(), x.device());
  if (y.numel()) CHORUS_KERNEL(x.device(), softmax_forward, r, y, log);
  return unpermute(y, perm);
}

Tensor softmax_backward(const Tensor& dy, const Tensor& y, int64_t dim, bool log) {
  dim = wrap_dim(dim, y.dim(), "softmax_backward");
  Shape perm;
  Tensor ry = rows_view(y, dim, &perm);
  Tensor rdy = rows_view(to_device(dy, y.device()), dim, &perm);
  Tensor dx = detail::empty_tensor(ry.sizes(), y.dtype(), y.device());
  if (dx.numel()) CHORUS_KERNEL(y.device(), softmax_backward, rdy, ry, dx, log);
  return unpermute(dx, perm);
}

std::pair<Tensor, Tensor> cross_entropy(const Tensor& logits, const Tensor& target, double smoothing) {
  CHORUS_CHECK(logits.dim() == 2, "cross_entropy: expected logits [batch, classes], got ", logits.describe());
  CHORUS_CHECK(target.dim() == 1 && target.size(0) == logits.size(0), "cross_entropy: targets ",
               target.describe(), " must be [", logits.size(0), "] for logits ", shape_str(logits.sizes()));
  CHORUS_CHECK(target.dtype() == kInt64 || target.dtype() == kInt32, "cross_entropy: targets must be int64, got ",
               target.describe());
  CHORUS_CHECK(smoothing >= 0 && smoothing < 1, "cross_entropy: label smoothing must be in [0, 1), got ", smoothing);
  Device dev = logits.device();
  Tensor lg = contiguous(logits);
  Tensor tg = contiguous(to_dtype(to_device(target, dev), kInt64));
  DType acc = logits.dtype() == kFloat64 ? kFloat64 : kFloat32;
  Tensor losses = detail::empty_tensor({lg.size(0)}, acc, dev);
  Tensor probs = detail::empty_tensor(lg.sizes(), acc, dev);
  if (lg.numel()) CHORUS_KERNEL(dev, cross_entropy_forward, lg, tg, smoothing, losses, probs);
  return {losses, probs};
}

Tensor cross_entropy_backward(const Tensor& dloss, const Tensor& probs, const Tensor& target,
                              double smoothing, DType logits_dtype) {
  Device dev = probs.device();
  Tensor tg = contiguous(to_dtype(to_device(target, dev), kInt64));
  Tensor dl = contiguous(to_dtype(to_device(dloss, dev), probs.dtype()));
  Tensor dx = detail::empty_tensor(probs.sizes(), probs.dtype(), dev);
  if (dx.numel()) CHORUS_KERNEL(dev, cross_entropy_backward, dl, probs, tg, smoothing, dx);
  return to_dtype(dx, logits_dtype);
}

Tensor dropout_mask(const Shape& shape, DType dt, Device dev, double p) {
  Tensor m = detail::empty_tensor(shape, dt, dev);
  // Before the counters are reserved, so that a step that falls back to eager
  // draws what it would have drawn (Note [CUDA graphs]).
  if (dev.is_cuda()) check_not_capturing("drawing random numbers (dropout)");
  if (m.numel()) CHORUS_KERNEL(dev, dropout_mask, m, p, default_generator().reserve(m.numel()));
  return m;
}

}  // namespace chorus::ops
