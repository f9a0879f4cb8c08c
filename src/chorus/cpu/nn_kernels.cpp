// The kernel-set entry points for convolution, pooling and batch norm on the
// CPU: thin wrappers that check tensors and hand raw float pointers to the
// kernels of conv2d.h, pool.h and batch_norm.h.
//
// Those kernels are float32 only. A bfloat16/float16 tensor goes through a
// float32 temporary (converted with the kernel set's copy) and results are
// rounded back once at the end, which is also the kernel-set rule "math in
// float32, convert on load/store". float64 is refused rather than silently
// computed in float: it exists for gradient checks, which float would spoil.
// The raw kernels report bad geometry with std::invalid_argument; it is
// rethrown as ValueError so callers see one error type.
#include <cmath>
#include <stdexcept>
#include <string>

#include "chorus/core/error.h"
#include "chorus/cpu/batch_norm.h"
#include "chorus/cpu/conv2d.h"
#include "chorus/cpu/kernels.h"
#include "chorus/cpu/pool.h"

namespace chorus::cpu {
namespace {

// Checks a required (or, with optional, possibly undefined) argument: a
// contiguous float32/bf16/f16 tensor of `shape`.
void check_arg(const char* op, const char* arg, const Tensor& t, const Shape& shape,
               bool optional = false) {
  if (optional && !t.defined()) return;
  detail::check_defined(t, op, arg);
  CHORUS_CHECK(t.dtype() == kFloat32 || t.dtype() == kBFloat16 || t.dtype() == kFloat16, op,
               ": ", arg, " must be float32, bfloat16 or float16 (the CPU kernels compute in "
               "float32), got ", t.describe());
  CHORUS_CHECK(t.is_contiguous(), op, ": ", arg, " must be contiguous, got ", t.describe());
  CHORUS_CHECK(t.sizes() == shape, op, ": ", arg, " must have shape ", shape_str(shape), ", got ",
               t.describe());
}

// An input as float32: the tensor itself, or a converted copy.
Tensor float32_input(const Tensor& t) {
  if (!t.defined() || t.dtype() == kFloat32) return t;
  Tensor f = detail::empty_tensor(t.sizes(), kFloat32, t.device());
  cpu::copy(t, f);
  return f;
}

// Where a kernel writes an output: the tensor itself, or a float32 scratch
// that write_back() rounds into it. Inputs/outputs that are read and updated
// (running stats) go through float32_input instead and are written back too.
Tensor float32_output(const Tensor& t) {
  if (!t.defined() || t.dtype() == kFloat32) return t;
  return detail::empty_tensor(t.sizes(), kFloat32, t.device());
}

void write_back(const Tensor& f32, const Tensor& t) {
  if (t.defined() && !f32.is_same(t)) cpu::copy(f32, t);
}

const float* in_ptr(const Tensor& t) { return t.defined() ? t.data<float>() : nullptr; }
float* out_ptr(const Tensor& t) { return t.defined() ? t.data<float>() : nullptr; }

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

void check_stat(const char* op, const char* arg, const Tensor& t, int64_t c) {
  detail::check_defined(t, op, arg);
  CHORUS_CHECK(t.dtype() == kFloat32 && t.is_contiguous() && t.sizes() == Shape{c}, op, ": ", arg,
               " must be contiguous float32 of shape [", c, "], got ", t.describe());
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
  const Tensor xf = float32_input(x), wf = float32_input(weight), bf = float32_input(bias);
  const Tensor yf = float32_output(y);
  run_kernel(op, [&] { conv2d_forward(s, in_ptr(xf), in_ptr(wf), in_ptr(bf), out_ptr(yf)); });
  write_back(yf, y);
}

void conv2d_backward_input(const Conv2dGeometry& g, const Tensor& dy, const Tensor& weight,
                           const Tensor& dx) {
  const char* op = "conv2d_backward_input";
  const Conv2dShape s = conv_shape(op, g);
  const ConvShapes z = conv_shapes(s);
  check_arg(op, "dy", dy, z.y);
  check_arg(op, "weight", weight, z.weight);
  check_arg(op, "dx", dx, z.x);
  const Tensor dyf = float32_input(dy), wf = float32_input(weight), dxf = float32_output(dx);
  run_kernel(op, [&] { conv2d_backward_input(s, in_ptr(dyf), in_ptr(wf), out_ptr(dxf)); });
  write_back(dxf, dx);
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
  const Tensor dyf = float32_input(dy), xf = float32_input(x);
  const Tensor dwf = float32_output(dweight), dbf = float32_output(dbias);
  run_kernel(op, [&] {
    conv2d_backward_weight(s, in_ptr(dyf), in_ptr(xf), out_ptr(dwf), out_ptr(dbf));
  });
  write_back(dwf, dweight);
  write_back(dbf, dbias);
}

// ---- pooling -------------------------------------------------------------------

void max_pool2d_forward(const Pool2dGeometry& g, const Tensor& x, const Tensor& y,
                        const Tensor& indices) {
  const char* op = "max_pool2d_forward";
  const Shape out = pool_output_shape(op, g);
  check_arg(op, "x", x, pool_input_shape(g));
  check_arg(op, "y", y, out);
  check_indices(op, indices, out);
  const Tensor xf = float32_input(x), yf = float32_output(y);
  run_kernel(op, [&] {
    max_pool2d_forward(in_ptr(xf), g.n, g.c, g.h, g.w, g.kh, g.kw, g.stride_h, g.stride_w,
                       g.pad_h, g.pad_w, out_ptr(yf), indices.data<int64_t>());
  });
  write_back(yf, y);
}

void max_pool2d_backward(const Pool2dGeometry& g, const Tensor& dy, const Tensor& indices,
                         const Tensor& dx) {
  const char* op = "max_pool2d_backward";
  const Shape out = pool_output_shape(op, g);
  check_arg(op, "dy", dy, out);
  check_indices(op, indices, out);
  check_arg(op, "dx", dx, pool_input_shape(g));
  const Tensor dyf = float32_input(dy), dxf = float32_output(dx);
  run_kernel(op, [&] {
    max_pool2d_backward(in_ptr(dyf), indices.data<int64_t>(), g.n, g.c, g.h, g.w, out[2], out[3],
                        out_ptr(dxf));
  });
  write_back(dxf, dx);
}

void avg_pool2d_forward(const Pool2dGeometry& g, const Tensor& x, const Tensor& y) {
  const char* op = "avg_pool2d_forward";
  check_arg(op, "x", x, pool_input_shape(g));
  check_arg(op, "y", y, pool_output_shape(op, g));
  const Tensor xf = float32_input(x), yf = float32_output(y);
  run_kernel(op, [&] {
    avg_pool2d_forward(in_ptr(xf), g.n, g.c, g.h, g.w, g.kh, g.kw, g.stride_h, g.stride_w,
                       g.pad_h, g.pad_w, out_ptr(yf));
  });
  write_back(yf, y);
}

void avg_pool2d_backward(const Pool2dGeometry& g, const Tensor& dy, const Tensor& dx) {
  const char* op = "avg_pool2d_backward";
  check_arg(op, "dy", dy, pool_output_shape(op, g));
  check_arg(op, "dx", dx, pool_input_shape(g));
  const Tensor dyf = float32_input(dy), dxf = float32_output(dx);
  run_kernel(op, [&] {
    avg_pool2d_backward(in_ptr(dyf), g.n, g.c, g.h, g.w, g.kh, g.kw, g.stride_h, g.stride_w,
                        g.pad_h, g.pad_w, out_ptr(dxf));
  });
  write_back(dxf, dx);
}

void adaptive_avg_pool2d_forward(const Tensor& x, const Tensor& y) {
  const char* op = "adaptive_avg_pool2d_forward";
  const Shape in = nchw_of(op, "x", x), out = nchw_of(op, "y", y);
  check_arg(op, "x", x, in);
  check_arg(op, "y", y, {in[0], in[1], out[2], out[3]});
  const Tensor xf = float32_input(x), yf = float32_output(y);
  run_kernel(op, [&] {
    adaptive_avg_pool2d_forward(in_ptr(xf), in[0], in[1], in[2], in[3], out[2], out[3],
                                out_ptr(yf));
  });
  write_back(yf, y);
}

void adaptive_avg_pool2d_backward(const Tensor& dy, const Tensor& dx) {
  const char* op = "adaptive_avg_pool2d_backward";
  const Shape out = nchw_of(op, "dy", dy), in = nchw_of(op, "dx", dx);
  check_arg(op, "dy", dy, {in[0], in[1], out[2], out[3]});
  check_arg(op, "dx", dx, in);
  const Tensor dyf = float32_input(dy), dxf = float32_output(dx);
  run_kernel(op, [&] {
    adaptive_avg_pool2d_backward(in_ptr(dyf), in[0], in[1], in[2], in[3], out[2], out[3],
                                 out_ptr(dxf));
  });
  write_back(dxf, dx);
}

// ---- batch norm ------------------------------------------------------------------

// In eval mode save_mean/save_invstd, when given, receive the running
// statistics as mean and 1/sqrt(var + eps): what an eval-mode backward
// (dx = dy * gamma * invstd) needs.
void batch_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                        const Tensor& running_mean, const Tensor& running_var, bool training,
                        double momentum, double eps, const Tensor& y, const Tensor& save_mean,
                        const Tensor& save_invstd) {
  const char* op = "batch_norm_forward";
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
  const Tensor xf = float32_input(x), gf = float32_input(gamma), bf = float32_input(beta);
  const Tensor rmf = float32_input(running_mean), rvf = float32_input(running_var);
  const Tensor yf = float32_output(y);
  run_kernel(op, [&] {
    if (training) {
      batch_norm_forward_train(in_ptr(xf), d.n, d.c, d.h, 1, in_ptr(gf), in_ptr(bf),
                               static_cast<float>(eps), static_cast<float>(momentum),
                               out_ptr(rmf), out_ptr(rvf), out_ptr(yf), save_mean.data<float>(),
                               save_invstd.data<float>());
    } else {
      batch_norm_forward_eval(in_ptr(xf), d.n, d.c, d.h, 1, in_ptr(gf), in_ptr(bf), in_ptr(rmf),
                              in_ptr(rvf), static_cast<float>(eps), out_ptr(yf));
    }
  });
  write_back(yf, y);
  if (training) {
    write_back(rmf, running_mean);
    write_back(rvf, running_var);
  } else {
    const float* rm = in_ptr(rmf);
    const float* rv = in_ptr(rvf);
    for (int64_t c = 0; c < d.c; ++c) {
      if (save_mean.defined()) save_mean.data<float>()[c] = rm[c];
      if (save_invstd.defined())
        save_invstd.data<float>()[c] = 1.0f / std::sqrt(rv[c] + static_cast<float>(eps));
    }
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
  const Tensor dyf = float32_input(dy), xf = float32_input(x), gf = float32_input(gamma);
  const Tensor dxf = float32_output(dx), dgf = float32_output(dgamma), dbf = float32_output(dbeta);
  run_kernel(op, [&] {
    batch_norm_backward(in_ptr(dyf), in_ptr(xf), d.n, d.c, d.h, 1, in_ptr(gf),
                        save_mean.data<float>(), save_invstd.data<float>(), out_ptr(dxf),
                        out_ptr(dgf), out_ptr(dbf));
  });
  write_back(dxf, dx);
  write_back(dgf, dgamma);
  write_back(dbf, dbeta);
}

}  // namespace chorus::cpu
