// The kernel-set batch norm on CUDA, through cuDNN's batch-norm calls.
//
// Channels-last 4-d tensors go to Chorus's own kernels instead (Note [NHWC
// batch norm] in batch_norm_nhwc.h); everything else to cuDNN.
//
// x/y may be bfloat16 or float16 with float32 parameters and statistics, the
// mix cuDNN wants (its parameter descriptor is float for every 16-bit data
// type). Parameters or running statistics in another dtype are converted to
// float32 temporaries and back, so a model cast wholesale to bfloat16 works
// too. Shapes: [N,C] is cuDNN's [N,C,1,1]; [N,C,L...] (contiguous) is
// [N,C,prod(L...),1]; 4-d tensors may be NCHW or channels-last (NHWC).
//
// cuDNN matches the contract: exponentialAverageFactor is PyTorch's momentum
// (running = (1 - momentum) * running + momentum * batch), the running variance
// is the unbiased one, and the saved statistics are mean and 1/sqrt(var + eps).
// The backward pass uses the saved statistics, so it needs no eps of its own.
#include "chorus/core/error.h"
#include "chorus/cuda/conv/batch_norm_nhwc.h"
#include "chorus/cuda/runtime/context.h"
#include "chorus/cuda/cudnn/cudnn_handle.h"
#include "chorus/cuda/kernels/kernels.h"

CHORUS_CUDNN_LEGACY_BEGIN

namespace chorus::cuda {

namespace {

// What cuDNN's backward takes as eps; unused because the saved statistics are
// always passed.
constexpr double kUnusedBackwardEps = 1e-5;

// A tensor as cuDNN's 4-d [N,C,H,W] in a layout.
struct BnShape {
  Layout layout;
  int64_t n, c, h, w;
};

BnShape bn_shape(const char* op, const Tensor& t, const char* name, Layout fallback) {
  CHORUS_CHECK(t.dim() >= 2, op, ": '", name, "' must be [N, C, *], got ", t.describe());
  if (t.dim() == 4) {
    return {layout_of(t, fallback, op, name), t.size(0), t.size(1), t.size(2), t.size(3)};
  }
  CHORUS_CHECK(t.is_contiguous(), op, ": '", name, "' must be contiguous, got ", t.describe(),
               " with strides ", shape_str(t.strides()));
  int64_t rest = 1;
  for (int64_t d = 2; d < t.dim(); ++d) rest *= t.size(d);
  return {Layout::NCHW, t.size(0), t.size(1), rest, 1};
}

TensorDesc desc_of(const BnShape& s, DType dtype, const char* op) {
  return TensorDesc(cudnn_dtype(dtype, op), s.layout, s.n, s.c, s.h, s.w);
}

// Spatial-persistent is cuDNN's fast NHWC path for 16-bit data (PyTorch uses it
// for channels-last training); forward-training and backward must agree, and
// both derive it from x alone.
cudnnBatchNormMode_t training_mode(const BnShape& x, DType dtype) {
  return x.layout == Layout::NHWC && dtype != kFloat32 ? CUDNN_BATCHNORM_SPATIAL_PERSISTENT
                                                       : CUDNN_BATCHNORM_SPATIAL;
}

// A float32 contiguous [C] tensor holding `t`'s values: `t` itself when it is
// one, a converted copy otherwise, or `value` everywhere when `t` is undefined.
Tensor float_input(const char* op, const Tensor& t, const char* name, int64_t c, double value,
                   Device device) {
  if (!t.defined()) {
    Tensor f = detail::empty_tensor({c}, kFloat32, device);
    fill(f, value);
    return f;
  }
  CHORUS_CHECK(t.numel() == c, op, ": '", name, "' must have ", c, " elements, got ", t.describe());
  if (t.dtype() == kFloat32 && t.is_contiguous()) return t;
  Tensor f = detail::empty_tensor(t.sizes(), kFloat32, device);
  copy(t, f);
  return f;
}

// A float32 contiguous [C] buffer for cuDNN to write `t` into: `t` itself when
// it is one, else a temporary that write_back() copies into `t`.
Tensor float_output(const char* op, const Tensor& t, const char* name, int64_t c, Device device) {
  if (t.defined()) {
    CHORUS_CHECK(t.numel() == c, op, ": '", name, "' must have ", c, " elements, got ",
                 t.describe());
    if (t.dtype() == kFloat32 && t.is_contiguous()) return t;
  }
  return detail::empty_tensor(t.defined() ? t.sizes() : Shape{c}, kFloat32, device);
}

void write_back(const Tensor& buffer, const Tensor& t) {
  if (t.defined() && !buffer.is_same(t)) copy(buffer, t);
}

void check_same(const char* op, const Tensor& a, const char* a_name, const Tensor& b,
                const char* b_name) {
  CHORUS_CHECK(a.sizes() == b.sizes() && a.dtype() == b.dtype(), op, ": '", a_name, "' and '",
               b_name, "' must share shape and dtype, got ", a.describe(), " and ", b.describe());
}

}  // namespace

namespace {

// batch_norm_forward, and with `relu` (training only) batch_norm_relu_forward.
void forward_impl(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                  const Tensor& running_mean, const Tensor& running_var, bool training,
                  double momentum, double eps, const Tensor& y, const Tensor& save_mean,
                  const Tensor& save_invstd, bool relu, const Tensor& num_batches_tracked,
                  const Tensor& sum_a = Tensor(), const Tensor& sum_b = Tensor()) {
  const char* op = relu ? "batch_norm_relu_forward" : "batch_norm_forward";
  check_same(op, x, "x", y, "y");
  if (num_batches_tracked.defined())
    CHORUS_CHECK(num_batches_tracked.dtype() == kInt64 && num_batches_tracked.numel() == 1 &&
                     num_batches_tracked.device() == x.device(),
                 op, ": num_batches_tracked must be an int64 scalar on ", x.device().str(), ", got ",
                 num_batches_tracked.describe());
  const Device device = x.device();
  CudaDeviceGuard guard(device.index);
  const BnShape xs = bn_shape(op, x, "x", Layout::NCHW);
  const BnShape ys = bn_shape(op, y, "y", xs.layout);
  const int64_t c = xs.c;
  if (x.numel() == 0) return;
  const Tensor g = float_input(op, gamma, "gamma", c, 1.0, device);
  const Tensor b = float_input(op, beta, "beta", c, 0.0, device);
  const float one = 1.0f, zero = 0.0f;
  const bool nhwc = xs.layout == Layout::NHWC && ys.layout == Layout::NHWC;
  // cuDNN's descriptors and handle only where cuDNN runs (not on the NHWC path,
  // which is called for every batch norm of a channels-last network).
  if (!training) {
    CHORUS_CHECK(running_mean.defined() && running_var.defined(), op,
                 ": evaluation mode needs running_mean and running_var");
    const Tensor rm = float_input(op, running_mean, "running_mean", c, 0.0, device);
    const Tensor rv = float_input(op, running_var, "running_var", c, 1.0, device);
    if (nhwc) {
      batch_norm_nhwc_forward_eval(x, g, b, rm, rv, eps, y);
      return;
    }
    const TensorDesc x_desc = desc_of(xs, x.dtype(), op), y_desc = desc_of(ys, y.dtype(), op);
    TensorDesc param_desc;
    CHORUS_CUDNN_CHECK(
        cudnnDeriveBNTensorDescriptor(param_desc.get(), x_desc.get(), CUDNN_BATCHNORM_SPATIAL));
    CHORUS_CUDNN_CHECK(cudnnBatchNormalizationForwardInference(
        cudnn_handle(device.index), CUDNN_BATCHNORM_SPATIAL, &one, &zero, x_desc.get(),
        x.raw_data(), y_desc.get(), y.raw_data(), param_desc.get(), g.raw_data(), b.raw_data(),
        rm.raw_data(), rv.raw_data(), eps));
    return;
  }

  CHORUS_CHECK(xs.n * xs.h * xs.w > 1, op, ": training needs more than one value per channel, got ",
               x.describe());
  // Undefined running statistics get scratch buffers rather than null pointers,
  // whose acceptance cuDNN documents only loosely.
  const Tensor rm = float_input(op, running_mean, "running_mean", c, 0.0, device);
  const Tensor rv = float_input(op, running_var, "running_var", c, 1.0, device);
  const Tensor sm = float_output(op, save_mean, "save_mean", c, device);
  const Tensor si = float_output(op, save_invstd, "save_invstd", c, device);
  if (sum_b.defined() && !nhwc) binary(BinaryOp::Add, sum_a, sum_b, x, 1.0);
  if (nhwc) {
    // The counter is incremented by the statistics' finalize kernel.
    if (sum_b.defined()) {
      batch_norm_nhwc_forward_train_sum(sum_a, sum_b, x, g, b, rm, rv, momentum, eps, y, sm, si, relu,
                                        num_batches_tracked);
    } else {
      batch_norm_nhwc_forward_train(x, g, b, rm, rv, momentum, eps, y, sm, si, relu, num_batches_tracked);
    }
  } else {
    if (num_batches_tracked.defined()) unary(UnaryOp::AddScalar, num_batches_tracked, num_batches_tracked, 1.0);
    const TensorDesc x_desc = desc_of(xs, x.dtype(), op), y_desc = desc_of(ys, y.dtype(), op);
    const cudnnBatchNormMode_t mode = training_mode(xs, x.dtype());
    TensorDesc param_desc;
    CHORUS_CUDNN_CHECK(cudnnDeriveBNTensorDescriptor(param_desc.get(), x_desc.get(), mode));
    CHORUS_CUDNN_CHECK(cudnnBatchNormalizationForwardTraining(
        cudnn_handle(device.index), mode, &one, &zero, x_desc.get(), x.raw_data(), y_desc.get(),
        y.raw_data(), param_desc.get(), g.raw_data(), b.raw_data(), momentum, rm.raw_data(),
        rv.raw_data(), eps, sm.raw_data(), si.raw_data()));
    if (relu) unary(UnaryOp::Relu, y, y, 0.0);
  }
  write_back(rm, running_mean);
  write_back(rv, running_var);
  write_back(sm, save_mean);
  write_back(si, save_invstd);
}

// batch_norm_backward, and with a defined relu_y batch_norm_relu_backward.
// dx_addend (may be undefined) is added to dx: in the elementwise pass on
// channels-last tensors, by a separate add otherwise.
void backward_impl(const Tensor& dy_in, const Tensor& relu_y, const Tensor& x, const Tensor& gamma,
                   const Tensor& beta, const Tensor& save_mean, const Tensor& save_invstd, const Tensor& dx,
                   const Tensor& dgamma, const Tensor& dbeta, const Tensor& dx_addend) {
  const char* op = relu_y.defined() ? "batch_norm_relu_backward" : "batch_norm_backward";
  Tensor dy = dy_in;
  check_same(op, x, "x", dy, "dy");
  check_same(op, x, "x", dx, "dx");
  CHORUS_CHECK(save_mean.defined() && save_invstd.defined(), op,
               ": needs the save_mean and save_invstd of the forward pass");
  const Device device = x.device();
  CudaDeviceGuard guard(device.index);
  const BnShape xs = bn_shape(op, x, "x", Layout::NCHW);
  const BnShape dys = bn_shape(op, dy, "dy", xs.layout);
  const BnShape dxs = bn_shape(op, dx, "dx", xs.layout);
  const int64_t c = xs.c;
  if (dx_addend.defined()) check_same(op, x, "x", dx_addend, "dx_addend");
  if (x.numel() == 0) {
    if (dgamma.defined()) fill(dgamma, 0.0);
    if (dbeta.defined()) fill(dbeta, 0.0);
    return;
  }
  const Tensor g = float_input(op, gamma, "gamma", c, 1.0, device);
  const Tensor sm = float_input(op, save_mean, "save_mean", c, 0.0, device);
  const Tensor si = float_input(op, save_invstd, "save_invstd", c, 1.0, device);
  const Tensor dg = float_output(op, dgamma, "dgamma", c, device);
  const Tensor db = float_output(op, dbeta, "dbeta", c, device);
  const bool nhwc = xs.layout == Layout::NHWC && dys.layout == Layout::NHWC &&
                    dxs.layout == Layout::NHWC &&
                    (!relu_y.defined() || bn_shape(op, relu_y, "y", xs.layout).layout == Layout::NHWC) &&
                    (!dx_addend.defined() || bn_shape(op, dx_addend, "dx_addend", xs.layout).layout == Layout::NHWC);
  if (nhwc) {
    // The ReLU's mask comes from x and the forward's coefficients, not from
    // relu_y (Note [ReLU mask from x] in batch_norm_nhwc.cu).
    const bool relu = relu_y.defined();
    const Tensor b = relu ? float_input(op, beta, "beta", c, 0.0, device) : Tensor();
    batch_norm_nhwc_backward(dy, x, g, sm, si, dx, dg, db, relu, b, dx_addend);
    write_back(dg, dgamma);
    write_back(db, dbeta);
    return;
  }
  if (relu_y.defined()) {  // the unfused way: mask first
    const Tensor masked = dy.dim() == 4 ? empty_in(dys.layout, dy.sizes(), dy.dtype(), dy.device())
                                        : detail::empty_tensor(dy.sizes(), dy.dtype(), dy.device());
    binary(BinaryOp::ReluGrad, dy, relu_y, masked, 1.0);
    dy = masked;
  }
  const TensorDesc x_desc = desc_of(xs, x.dtype(), op), dy_desc = desc_of(dys, dy.dtype(), op),
                   dx_desc = desc_of(dxs, dx.dtype(), op);
  const cudnnBatchNormMode_t mode = training_mode(xs, x.dtype());
  TensorDesc param_desc;
  CHORUS_CUDNN_CHECK(cudnnDeriveBNTensorDescriptor(param_desc.get(), x_desc.get(), mode));
  const float one = 1.0f, zero = 0.0f;
  CHORUS_CUDNN_CHECK(cudnnBatchNormalizationBackward(
      cudnn_handle(device.index), mode, &one, &zero, &one, &zero, x_desc.get(), x.raw_data(),
      dy_desc.get(), dy.raw_data(), dx_desc.get(), dx.raw_data(), param_desc.get(), g.raw_data(),
      dg.raw_data(), db.raw_data(), kUnusedBackwardEps, sm.raw_data(), si.raw_data()));
  if (dx_addend.defined()) binary(BinaryOp::Add, dx, dx_addend, dx, 1.0);
  write_back(dg, dgamma);
  write_back(db, dbeta);
}

}  // namespace

void batch_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                        const Tensor& running_mean, const Tensor& running_var, bool training,
                        double momentum, double eps, const Tensor& y, const Tensor& save_mean,
                        const Tensor& save_invstd, const Tensor& num_batches_tracked) {
  forward_impl(x, gamma, beta, running_mean, running_var, training, momentum, eps, y, save_mean,
               save_invstd, false, training ? num_batches_tracked : Tensor());
}

void batch_norm_relu_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                             const Tensor& running_mean, const Tensor& running_var,
                             double momentum, double eps, const Tensor& y,
                             const Tensor& save_mean, const Tensor& save_invstd,
                             const Tensor& num_batches_tracked) {
  forward_impl(x, gamma, beta, running_mean, running_var, true, momentum, eps, y, save_mean,
               save_invstd, true, num_batches_tracked);
}

void batch_norm_relu_sum_forward(const Tensor& a, const Tensor& b, const Tensor& s, const Tensor& gamma,
                                 const Tensor& beta, const Tensor& running_mean, const Tensor& running_var,
                                 double momentum, double eps, const Tensor& y, const Tensor& save_mean,
                                 const Tensor& save_invstd, const Tensor& num_batches_tracked) {
  const char* op = "batch_norm_relu_sum_forward";
  check_same(op, a, "a", s, "s");
  check_same(op, b, "b", s, "s");
  check_same(op, s, "s", y, "y");
  CHORUS_CHECK(a.device() == s.device() && b.device() == s.device(), op, ": a ", a.describe(), " and b ",
               b.describe(), " must be on ", s.device().str());
  // One pass for the sum and the statistics where all four are channels-last
  // (the NHWC kernels); elsewhere the add, then the batch norm.
  // (forward_impl adds first where x and y take cuDNN's path after all.)
  if (a.dim() == 4 && is_dense_in(a, Layout::NHWC) && is_dense_in(b, Layout::NHWC)) {
    forward_impl(s, gamma, beta, running_mean, running_var, true, momentum, eps, y, save_mean, save_invstd, true,
                 num_batches_tracked, a, b);
    return;
  }
  binary(BinaryOp::Add, a, b, s, 1.0);
  forward_impl(s, gamma, beta, running_mean, running_var, true, momentum, eps, y, save_mean, save_invstd, true,
               num_batches_tracked);
}

void batch_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                         const Tensor& save_mean, const Tensor& save_invstd, const Tensor& dx,
                         const Tensor& dgamma, const Tensor& dbeta) {
  backward_impl(dy, Tensor(), x, gamma, Tensor(), save_mean, save_invstd, dx, dgamma, dbeta, Tensor());
}

void batch_norm_relu_backward(const Tensor& dy, const Tensor& y, const Tensor& x,
                              const Tensor& gamma, const Tensor& beta, const Tensor& save_mean,
                              const Tensor& save_invstd, const Tensor& dx, const Tensor& dgamma,
                              const Tensor& dbeta, const Tensor& dx_addend) {
  check_same("batch_norm_relu_backward", x, "x", y, "y");
  backward_impl(dy, y, x, gamma, beta, save_mean, save_invstd, dx, dgamma, dbeta, dx_addend);
}

}  // namespace chorus::cuda

CHORUS_CUDNN_LEGACY_END
