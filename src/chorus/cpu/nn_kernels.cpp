// The kernel-set entry points for convolution, pooling and batch norm on the
// CPU: thin wrappers that check tensors and hand raw pointers to the kernels
// of conv2d.h, pool.h and batch_norm.h (float32), or of nn_kernels_f64.h
// (float64).
//
// The compute dtype is float64 when any operand is float64, float32
// otherwise. float64 exists for gradient checks, which float would spoil, so
// it goes to the naive double kernels rather than being rounded through the
// fast float ones. A bfloat16/float16 tensor goes through a float32 temporary
// (converted with the kernel set's copy) and results are rounded back once at
// the end, which is also the kernel-set rule "math in float32, convert on
// load/store"; an operand whose dtype differs from the compute dtype is
// converted the same way. The raw kernels report bad geometry with
// std::invalid_argument; it is rethrown as ValueError so callers see one
// error type.
#include <cmath>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "chorus/core/error.h"
#include "chorus/cpu/batch_norm.h"
#include "chorus/cpu/conv2d.h"
#include "chorus/cpu/kernels.h"
#include "chorus/cpu/nn_kernels_f64.h"
#include "chorus/cpu/pool.h"

namespace chorus::cpu {
namespace {

bool is_float_dtype(DType t) {
  return t == kFloat32 || t == kFloat64 || t == kBFloat16 || t == kFloat16;
}

// Checks a required (or, with optional, possibly undefined) argument: a
// contiguous floating-point tensor of `shape`.
void check_arg(const char* op, const char* arg, const Tensor& t, const Shape& shape,
               bool optional = false) {
  if (optional && !t.defined()) return;
  detail::check_defined(t, op, arg);
  CHORUS_CHECK(is_float_dtype(t.dtype()), op, ": ", arg,
               " must be float32, float64, bfloat16 or float16, got ", t.describe());
  CHORUS_CHECK(t.is_contiguous(), op, ": ", arg, " must be contiguous, got ", t.describe());
  CHORUS_CHECK(t.sizes() == shape, op, ": ", arg, " must have shape ", shape_str(shape), ", got ",
               t.describe());
}

// float64 when any defined operand is float64, else float32.
DType compute_dtype(std::initializer_list<const Tensor*> operands) {
  for (const Tensor* t : operands)
    if (t->defined() && t->dtype() == kFloat64) return kFloat64;
  return kFloat32;
}

// An input in the compute dtype: the tensor itself, or a converted copy.
Tensor compute_input(const Tensor& t, DType ct) {
  if (!t.defined() || t.dtype() == ct) return t;
  Tensor f = detail::empty_tensor(t.sizes(), ct, t.device());
  cpu::copy(t, f);
  return f;
}

// Where a kernel writes an output: the tensor itself, or a compute-dtype
// scratch that write_back() converts into it. Inputs/outputs that are read
// and updated (running stats) go through compute_input instead and are
// written back too.
Tensor compute_output(const Tensor& t, DType ct) {
  if (!t.defined() || t.dtype() == ct) return t;
  return detail::empty_tensor(t.sizes(), ct, t.device());
}

void write_back(const Tensor& scratch, const Tensor& t) {
  if (t.defined() && !scratch.is_same(t)) cpu::copy(scratch, t);
}

template <typename T>
const T* in_ptr(const Tensor& t) {
  return t.defined() ? t.data<T>() : nullptr;
}
template <typename T>
T* out_ptr(const Tensor& t) {
  return t.defined() ? t.data<T>() : nullptr;
}

// Runs a raw kernel, turning its std::invalid_argument into a ValueError
// that names `op` (the raw kernels name themselves, helpers may not).
template <typename F>
void run_kernel(const char* op, F&& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    if (what.rfind(op, 0) == 0) CHORUS_THROW(ValueError, what);
    CHORUS_THROW(ValueError, op, ": ", what);
  }
}

Conv2dShape conv_shape(const char* op, const Conv2dGeometry& g) {
  const Conv2dShape s{g.n,        g.c_in,     g.h,     g.w,     g.c_out, g.kh,    g.kw,
                      g.stride_h, g.stride_w, g.pad_h, g.pad_w, g.dil_h, g.dil_w, g.groups};
  run_kernel(op, [&] { check_conv2d_shape(op, s); });
  return s;
}

// The four conv tensor shapes of a checked geometry.
struct ConvShapes {
  Shape x, weight, bias, y;
};
ConvShapes conv_shapes(const Conv2dShape& s) {
  return {{s.n, s.c_in, s.h, s.w},
          {s.c_out, s.c_in / s.groups, s.kh, s.kw},
          {s.c_out},
          {s.n, s.c_out, s.out_h(), s.out_w()}};
}

Shape pool_input_shape(const Pool2dGeometry& g) { return {g.n, g.c, g.h, g.w}; }

Shape pool_output_shape(const char* op, const Pool2dGeometry& g) {
  int64_t oh = 0, ow = 0;
  run_kernel(op, [&] {
    oh = pool_out_size(g.h, g.kh, g.stride_h, g.pad_h);
    ow = pool_out_size(g.w, g.kw, g.stride_w, g.pad_w);
  });
  return {g.n, g.c, oh, ow};
}

void check_indices(const char* op, const Tensor& indices, const Shape& shape) {
  detail::check_defined(indices, op, "indices");
  CHORUS_CHECK(indices.dtype() == kInt64 && indices.is_contiguous() && indices.sizes() == shape,
               op, ": indices must be contiguous int64 of shape ", shape_str(shape), ", got ",
               indices.describe());
}

// Batch norm sees [N, C, *] as the raw kernels' [n, c, h, w] with h = the
// product of the spatial dims and w = 1 (same memory, contiguous).
struct BnDims {
  int64_t n, c, h;
};
BnDims bn_dims(const char* op, const Tensor& x) {
  detail::check_defined(x, op, "x");
  CHORUS_CHECK(x.dim() >= 2, op, ": x must be [N, C, *], got ", x.describe());
  int64_t spatial = 1;
  for (int64_t k = 2; k < x.dim(); ++k) spatial *= x.size(k);
  return {x.size(0), x.size(1), spatial};
}

// save_mean / save_invstd: float32, or float64 (what ops::batch_norm
// allocates for a float64 input).
void check_stat(const char* op, const char* arg, const Tensor& t, int64_t c) {
  detail::check_defined(t, op, arg);
  CHORUS_CHECK((t.dtype() == kFloat32 || t.dtype() == kFloat64) && t.is_contiguous() &&
                   t.sizes() == Shape{c},
               op, ": ", arg, " must be contiguous float32 or float64 of shape [", c, "], got ",
               t.describe());
}

// [N, C, H, W] of a 4-d tensor argument, for the adaptive pools.
Shape nchw_of(const char* op, const char* arg, const Tensor& t) {
  detail::check_defined(t, op, arg);
  CHORUS_CHECK(t.dim() == 4, op, ": ", arg, " must be 4-d [N, C, H, W], got ", t.describe());
  return t.sizes();
}

}  // namespace

// ---- convolution -------------------------------------------------------------

void conv2d_forward(const Conv2dGeometry& g, const Tensor& x, const Tensor& weight,
                    const Tensor& bias, const Tensor& y) {
  const char* op = "conv2d_forward";
  const Conv2dShape s = conv_shape(op, g);
  const ConvShapes z = conv_shapes(s);
  check_arg(op, "x", x, z.x);
  check_arg(op, "weight", weight, z.weight);
  check_arg(op, "bias", bias, z.bias, /*optional=*/true);
  check_arg(op, "y", y, z.y);
  const DType ct = compute_dtype({&x, &weight, &bias, &y});
  const Tensor xc = compute_input(x, ct), wc = compute_input(weight, ct);
  const Tensor bc = compute_input(bias, ct), yc = compute_output(y, ct);
  run_kernel(op, [&] {
    if (ct == kFloat64) {
      f64::conv2d_forward(s, in_ptr<double>(xc), in_ptr<double>(wc), in_ptr<double>(bc),
                          out_ptr<double>(yc));
    } else {
      conv2d_forward(s, in_ptr<float>(xc), in_ptr<float>(wc), in_ptr<float>(bc),
                     out_ptr<float>(yc));
    }
  });
  write_back(yc, y);
}

void conv2d_forward_add(const Conv2dGeometry& g, const Tensor& x, const Tensor& weight, const Tensor& residual,
                        const Tensor& y) {
  check_arg("conv2d_forward_add", "residual", residual, y.sizes());
  const auto* r0 = static_cast<const char*>(residual.raw_data());
  const auto* y0 = static_cast<const char*>(y.raw_data());
  CHORUS_CHECK(r0 >= y0 + y.nbytes() || y0 >= r0 + residual.nbytes(), "conv2d_forward_add: residual ", residual.describe(),
               " overlaps the output ", y.describe(), " (the convolution would overwrite it before the add)");
  conv2d_forward(g, x, weight, Tensor(), y);
  binary(BinaryOp::Add, y, residual, y, 1.0);
}

bool conv2d_add_defers(const Conv2dGeometry&, const Tensor&, const Tensor&, const Tensor&) { return true; }

void conv2d_backward_input(const Conv2dGeometry& g, const Tensor& dy, const Tensor& weight,
                           const Tensor& dx) {
  const char* op = "conv2d_backward_input";
  const Conv2dShape s = conv_shape(op, g);
  const ConvShapes z = conv_shapes(s);
  check_arg(op, "dy", dy, z.y);
  check_arg(op, "weight", weight, z.weight);
  check_arg(op, "dx", dx, z.x);
  const DType ct = compute_dtype({&dy, &weight, &dx});
  const Tensor dyc = compute_input(dy, ct), wc = compute_input(weight, ct);
  const Tensor dxc = compute_output(dx, ct);
  run_kernel(op, [&] {
    if (ct == kFloat64) {
      f64::conv2d_backward_input(s, in_ptr<double>(dyc), in_ptr<double>(wc), out_ptr<double>(dxc));
    } else {
      conv2d_backward_input(s, in_ptr<float>(dyc), in_ptr<float>(wc), out_ptr<float>(dxc));
    }
  });
  write_back(dxc, dx);
}

void conv2d_backward_weight(const Conv2dGeometry& g, const Tensor& dy, const Tensor& x,
                            const Tensor& dweight, const Tensor& dbias) {
  const char* op = "conv2d_backward_weight";
  const Conv2dShape s = conv_shape(op, g);
  const ConvShapes z = conv_shapes(s);
  check_arg(op, "dy", dy, z.y);
  check_arg(op, "x", x, z.x);
  check_arg(op, "dweight", dweight, z.weight);
  check_arg(op, "dbias", dbias, z.bias, /*optional=*/true);
  const DType ct = compute_dtype({&dy, &x, &dweight, &dbias});
  const Tensor dyc = compute_input(dy, ct), xc = compute_input(x, ct);
  const Tensor dwc = compute_output(dweight, ct), dbc = compute_output(dbias, ct);
  run_kernel(op, [&] {
    if (ct == kFloat64) {
      f64::conv2d_backward_weight(s, in_ptr<double>(dyc), in_ptr<double>(xc),
                                  out_ptr<double>(dwc), out_ptr<double>(dbc));
    } else {
      conv2d_backward_weight(s, in_ptr<float>(dyc), in_ptr<float>(xc), out_ptr<float>(dwc),
                             out_ptr<float>(dbc));
    }
  });
  write_back(dwc, dweight);
  write_back(dbc, dbias);
}

// ---- pooling -------------------------------------------------------------------

void max_pool2d_forward(const Pool2dGeometry& g, const Tensor& x, const Tensor& y,
                        const Tensor& indices) {
  const char* op = "max_pool2d_forward";
  const Shape out = pool_output_shape(op, g);
  check_arg(op, "x", x, pool_input_shape(g));
  check_arg(op, "y", y, out);
  check_indices(op, indices, out);
  const DType ct = compute_dtype({&x, &y});
  const Tensor xc = compute_input(x, ct), yc = compute_output(y, ct);
  run_kernel(op, [&] {
    if (ct == kFloat64) {
      f64::max_pool2d_forward(in_ptr<double>(xc), g.n, g.c, g.h, g.w, g.kh, g.kw, g.stride_h,
                              g.stride_w, g.pad_h, g.pad_w, out_ptr<double>(yc),
                              indices.data<int64_t>());
    } else {
      max_pool2d_forward(in_ptr<float>(xc), g.n, g.c, g.h, g.w, g.kh, g.kw, g.stride_h,
                         g.stride_w, g.pad_h, g.pad_w, out_ptr<float>(yc),
                         indices.data<int64_t>());
    }
  });
  write_back(yc, y);
}

void max_pool2d_backward(const Pool2dGeometry& g, const Tensor& dy, const Tensor& indices,
                         const Tensor& dx) {
  const char* op = "max_pool2d_backward";
  const Shape out = pool_output_shape(op, g);
  check_arg(op, "dy", dy, out);
  check_indices(op, indices, out);
  check_arg(op, "dx", dx, pool_input_shape(g));
  const DType ct = compute_dtype({&dy, &dx});
  const Tensor dyc = compute_input(dy, ct), dxc = compute_output(dx, ct);
  run_kernel(op, [&] {
    if (ct == kFloat64) {
      f64::max_pool2d_backward(in_ptr<double>(dyc), indices.data<int64_t>(), g.n, g.c, g.h, g.w,
                               out[2], out[3], out_ptr<double>(dxc));
    } else {
      max_pool2d_backward(in_ptr<float>(dyc), indices.data<int64_t>(), g.n, g.c, g.h, g.w,
                          out[2], out[3], out_ptr<float>(dxc));
    }
  });
  write_back(dxc, dx);
}

void avg_pool2d_forward(const Pool2dGeometry& g, const Tensor& x, const Tensor& y) {
  const char* op = "avg_pool2d_forward";
  check_arg(op, "x", x, pool_input_shape(g));
  check_arg(op, "y", y, pool_output_shape(op, g));
  const DType ct = compute_dtype({&x, &y});
  const Tensor xc = compute_input(x, ct), yc = compute_output(y, ct);
  run_kernel(op, [&] {
    if (ct == kFloat64) {
      f64::avg_pool2d_forward(in_ptr<double>(xc), g.n, g.c, g.h, g.w, g.kh, g.kw, g.stride_h,
                              g.stride_w, g.pad_h, g.pad_w, out_ptr<double>(yc));
    } else {
      avg_pool2d_forward(in_ptr<float>(xc), g.n, g.c, g.h, g.w, g.kh, g.kw, g.stride_h,
                         g.stride_w, g.pad_h, g.pad_w, out_ptr<float>(yc));
    }
  });
  write_back(yc, y);
}

void avg_pool2d_backward(const Pool2dGeometry& g, const Tensor& dy, const Tensor& dx) {
  const char* op = "avg_pool2d_backward";
  check_arg(op, "dy", dy, pool_output_shape(op, g));
  check_arg(op, "dx", dx, pool_input_shape(g));
  const DType ct = compute_dtype({&dy, &dx});
  const Tensor dyc = compute_input(dy, ct), dxc = compute_output(dx, ct);
  run_kernel(op, [&] {
    if (ct == kFloat64) {
      f64::avg_pool2d_backward(in_ptr<double>(dyc), g.n, g.c, g.h, g.w, g.kh, g.kw, g.stride_h,
                               g.stride_w, g.pad_h, g.pad_w, out_ptr<double>(dxc));
    } else {
      avg_pool2d_backward(in_ptr<float>(dyc), g.n, g.c, g.h, g.w, g.kh, g.kw, g.stride_h,
                          g.stride_w, g.pad_h, g.pad_w, out_ptr<float>(dxc));
    }
  });
  write_back(dxc, dx);
}

void adaptive_avg_pool2d_forward(const Tensor& x, const Tensor& y) {
  const char* op = "adaptive_avg_pool2d_forward";
  const Shape in = nchw_of(op, "x", x), out = nchw_of(op, "y", y);
  check_arg(op, "x", x, in);
  check_arg(op, "y", y, {in[0], in[1], out[2], out[3]});
  const DType ct = compute_dtype({&x, &y});
  const Tensor xc = compute_input(x, ct), yc = compute_output(y, ct);
  run_kernel(op, [&] {
    if (ct == kFloat64) {
      f64::adaptive_avg_pool2d_forward(in_ptr<double>(xc), in[0], in[1], in[2], in[3], out[2],
                                       out[3], out_ptr<double>(yc));
    } else {
      adaptive_avg_pool2d_forward(in_ptr<float>(xc), in[0], in[1], in[2], in[3], out[2], out[3],
                                  out_ptr<float>(yc));
    }
  });
  write_back(yc, y);
}

void adaptive_avg_pool2d_backward(const Tensor& dy, const Tensor& dx) {
  const char* op = "adaptive_avg_pool2d_backward";
  const Shape out = nchw_of(op, "dy", dy), in = nchw_of(op, "dx", dx);
  check_arg(op, "dy", dy, {in[0], in[1], out[2], out[3]});
  check_arg(op, "dx", dx, in);
  const DType ct = compute_dtype({&dy, &dx});
  const Tensor dyc = compute_input(dy, ct), dxc = compute_output(dx, ct);
  run_kernel(op, [&] {
    if (ct == kFloat64) {
      f64::adaptive_avg_pool2d_backward(in_ptr<double>(dyc), in[0], in[1], in[2], in[3], out[2],
                                        out[3], out_ptr<double>(dxc));
    } else {
      adaptive_avg_pool2d_backward(in_ptr<float>(dyc), in[0], in[1], in[2], in[3], out[2],
                                   out[3], out_ptr<float>(dxc));
    }
  });
  write_back(dxc, dx);
}

// ---- batch norm ------------------------------------------------------------------

namespace {
// Eval mode: save_mean/save_invstd (compute dtype, when defined) receive the
// running statistics as mean and 1/sqrt(var + eps).
template <typename T>
void save_running_stats(const Tensor& rm, const Tensor& rv, double eps, int64_t c,
                        const Tensor& save_mean, const Tensor& save_invstd) {
  const T* m = in_ptr<T>(rm);
  const T* v = in_ptr<T>(rv);
  for (int64_t ch = 0; ch < c; ++ch) {
    if (save_mean.defined()) save_mean.data<T>()[ch] = m[ch];
    if (save_invstd.defined())
      save_invstd.data<T>()[ch] = T(1) / std::sqrt(v[ch] + static_cast<T>(eps));
  }
}
}  // namespace

// In eval mode save_mean/save_invstd, when given, receive the running
// statistics as mean and 1/sqrt(var + eps): what an eval-mode backward
// (dx = dy * gamma * invstd) needs.
void batch_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                        const Tensor& running_mean, const Tensor& running_var, bool training,
                        double momentum, double eps, const Tensor& y, const Tensor& save_mean,
                        const Tensor& save_invstd, const Tensor& num_batches_tracked) {
  const char* op = "batch_norm_forward";
  if (num_batches_tracked.defined())
    CHORUS_CHECK(num_batches_tracked.dtype() == kInt64 && num_batches_tracked.numel() == 1 &&
                     num_batches_tracked.device() == x.device(),
                 op, ": num_batches_tracked must be an int64 scalar on ", x.device().str(), ", got ",
                 num_batches_tracked.describe());
  const BnDims d = bn_dims(op, x);
  check_arg(op, "x", x, x.sizes());
  check_arg(op, "y", y, x.sizes());
  check_arg(op, "gamma", gamma, {d.c}, /*optional=*/true);
  check_arg(op, "beta", beta, {d.c}, /*optional=*/true);
  // Training updates running stats only when they exist; eval needs them.
  check_arg(op, "running_mean", running_mean, {d.c}, /*optional=*/training);
  check_arg(op, "running_var", running_var, {d.c}, /*optional=*/training);
  CHORUS_CHECK(running_mean.defined() == running_var.defined(), op,
               ": running_mean and running_var must be both defined or both undefined");
  if (training || save_mean.defined()) check_stat(op, "save_mean", save_mean, d.c);
  if (training || save_invstd.defined()) check_stat(op, "save_invstd", save_invstd, d.c);
  const DType ct = compute_dtype({&x, &gamma, &beta, &running_mean, &running_var, &y});
  const Tensor xc = compute_input(x, ct), gc = compute_input(gamma, ct);
  const Tensor bc = compute_input(beta, ct);
  const Tensor rmc = compute_input(running_mean, ct), rvc = compute_input(running_var, ct);
  const Tensor yc = compute_output(y, ct);
  const Tensor smc = compute_output(save_mean, ct), sic = compute_output(save_invstd, ct);
  run_kernel(op, [&] {
    if (ct == kFloat64 && training) {
      f64::batch_norm_forward_train(in_ptr<double>(xc), d.n, d.c, d.h, 1, in_ptr<double>(gc),
                                    in_ptr<double>(bc), eps, momentum, out_ptr<double>(rmc),
                                    out_ptr<double>(rvc), out_ptr<double>(yc),
                                    out_ptr<double>(smc), out_ptr<double>(sic));
    } else if (ct == kFloat64) {
      f64::batch_norm_forward_eval(in_ptr<double>(xc), d.n, d.c, d.h, 1, in_ptr<double>(gc),
                                   in_ptr<double>(bc), in_ptr<double>(rmc), in_ptr<double>(rvc),
                                   eps, out_ptr<double>(yc));
      save_running_stats<double>(rmc, rvc, eps, d.c, smc, sic);
    } else if (training) {
      batch_norm_forward_train(in_ptr<float>(xc), d.n, d.c, d.h, 1, in_ptr<float>(gc),
                               in_ptr<float>(bc), static_cast<float>(eps),
                               static_cast<float>(momentum), out_ptr<float>(rmc),
                               out_ptr<float>(rvc), out_ptr<float>(yc), out_ptr<float>(smc),
                               out_ptr<float>(sic));
    } else {
      batch_norm_forward_eval(in_ptr<float>(xc), d.n, d.c, d.h, 1, in_ptr<float>(gc),
                              in_ptr<float>(bc), in_ptr<float>(rmc), in_ptr<float>(rvc),
                              static_cast<float>(eps), out_ptr<float>(yc));
      save_running_stats<float>(rmc, rvc, eps, d.c, smc, sic);
    }
  });
  write_back(yc, y);
  write_back(smc, save_mean);
  write_back(sic, save_invstd);
  if (training) {
    write_back(rmc, running_mean);
    write_back(rvc, running_var);
    if (num_batches_tracked.defined()) ++*static_cast<int64_t*>(num_batches_tracked.raw_data());
  }
}

void batch_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                         const Tensor& save_mean, const Tensor& save_invstd, const Tensor& dx,
                         const Tensor& dgamma, const Tensor& dbeta) {
  const char* op = "batch_norm_backward";
  const BnDims d = bn_dims(op, x);
  check_arg(op, "x", x, x.sizes());
  check_arg(op, "dy", dy, x.sizes());
  check_arg(op, "dx", dx, x.sizes(), /*optional=*/true);
  check_arg(op, "gamma", gamma, {d.c}, /*optional=*/true);
  check_stat(op, "save_mean", save_mean, d.c);
  check_stat(op, "save_invstd", save_invstd, d.c);
  check_arg(op, "dgamma", dgamma, {d.c}, /*optional=*/true);
  check_arg(op, "dbeta", dbeta, {d.c}, /*optional=*/true);
  const DType ct = compute_dtype({&dy, &x, &gamma, &save_mean, &save_invstd, &dx, &dgamma, &dbeta});
  const Tensor dyc = compute_input(dy, ct), xc = compute_input(x, ct);
  const Tensor gc = compute_input(gamma, ct);
  const Tensor smc = compute_input(save_mean, ct), sic = compute_input(save_invstd, ct);
  const Tensor dxc = compute_output(dx, ct), dgc = compute_output(dgamma, ct);
  const Tensor dbc = compute_output(dbeta, ct);
  run_kernel(op, [&] {
    if (ct == kFloat64) {
      f64::batch_norm_backward(in_ptr<double>(dyc), in_ptr<double>(xc), d.n, d.c, d.h, 1,
                               in_ptr<double>(gc), in_ptr<double>(smc), in_ptr<double>(sic),
                               out_ptr<double>(dxc), out_ptr<double>(dgc), out_ptr<double>(dbc));
    } else {
      batch_norm_backward(in_ptr<float>(dyc), in_ptr<float>(xc), d.n, d.c, d.h, 1,
                          in_ptr<float>(gc), in_ptr<float>(smc), in_ptr<float>(sic),
                          out_ptr<float>(dxc), out_ptr<float>(dgc), out_ptr<float>(dbc));
    }
  });
  write_back(dxc, dx);
  write_back(dgc, dgamma);
  write_back(dbc, dbeta);
}

// The fused pair composed from the unfused kernels (CPU batch norm is a
// separate pass anyway; the fusion pays on GPUs).
void batch_norm_relu_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                             const Tensor& running_mean, const Tensor& running_var,
                             double momentum, double eps, const Tensor& y,
                             const Tensor& save_mean, const Tensor& save_invstd,
                             const Tensor& num_batches_tracked) {
  batch_norm_forward(x, gamma, beta, running_mean, running_var, true, momentum, eps, y, save_mean,
                     save_invstd, num_batches_tracked);
  unary(UnaryOp::Relu, y, y, 0.0);
}

void batch_norm_relu_sum_forward(const Tensor& a, const Tensor& b, const Tensor& s, const Tensor& gamma,
                                 const Tensor& beta, const Tensor& running_mean, const Tensor& running_var,
                                 double momentum, double eps, const Tensor& y, const Tensor& save_mean,
                                 const Tensor& save_invstd, const Tensor& num_batches_tracked) {
  binary(BinaryOp::Add, a, b, s, 1.0);
  batch_norm_relu_forward(s, gamma, beta, running_mean, running_var, momentum, eps, y, save_mean, save_invstd,
                          num_batches_tracked);
}

void batch_norm_relu_backward(const Tensor& dy, const Tensor& y, const Tensor& x,
                              const Tensor& gamma, const Tensor& /*beta*/, const Tensor& save_mean,
                              const Tensor& save_invstd, const Tensor& dx, const Tensor& dgamma,
                              const Tensor& dbeta, const Tensor& dx_addend) {
  Tensor masked = detail::empty_tensor(dy.sizes(), dy.dtype(), dy.device());
  binary(BinaryOp::ReluGrad, dy, y, masked, 1.0);
  batch_norm_backward(masked, x, gamma, save_mean, save_invstd, dx, dgamma, dbeta);
  if (dx_addend.defined()) binary(BinaryOp::Add, dx, dx_addend, dx, 1.0);
}

}  // namespace chorus::cpu
