// Fused optimizer updates on the CPU: one pass over param, grad and state.
//
// The math is PyTorch's torch.optim.SGD / AdamW (single-tensor path) so that
// a training run can be compared step for step with PyTorch:
//   SGD:   g = grad + wd * param
//          buf = first_step ? g : momentum * buf + (1 - dampening) * g
//          g = nesterov ? g + momentum * buf : buf        (only if momentum != 0)
//          param -= lr * g
//   AdamW: param *= 1 - lr * wd                            (decoupled decay)
//          m = b1 * m + (1 - b1) * g;  v = b2 * v + (1 - b2) * g * g
//          param -= (lr / bias1) * m / (sqrt(v) / sqrt(bias2) + eps)
// with bias_k = 1 - b_k^step in double, as PyTorch computes them in Python.
// Elementwise math is in the parameter's dtype: float32 (master weights), or
// float64 for double-precision reference runs (the state is float64 then too).
// The loops are memory-bound, so one thread.
#include <cmath>
#include <cstdint>

#include "chorus/core/error.h"
#include "chorus/cpu/kernels.h"

namespace chorus::cpu {
namespace {

void check_state(const char* op, const char* arg, const Tensor& t, const Tensor& param) {
  detail::check_defined(t, op, arg);
  CHORUS_CHECK((param.dtype() == kFloat32 || param.dtype() == kFloat64) && t.dtype() == param.dtype() &&
                   t.is_contiguous() && t.sizes() == param.sizes(),
               op, ": ", arg, " must be contiguous float32 or float64 with param's dtype and shape ",
               shape_str(param.sizes()), ", got ", t.describe());
}

template <typename T>
void sgd_loop(const Tensor& param, const Tensor& grad, const Tensor& momentum_buf, double lr, double momentum,
              double dampening, double weight_decay, bool nesterov, bool first_step) {
  const T lr_t = static_cast<T>(lr), mom = static_cast<T>(momentum);
  const T damp = static_cast<T>(1.0 - dampening), wd = static_cast<T>(weight_decay);
  T* p = param.data<T>();
  const T* gr = grad.data<T>();
  T* buf = momentum != 0 ? momentum_buf.data<T>() : nullptr;
  const int64_t n = param.numel();
  for (int64_t i = 0; i < n; ++i) {
    T g = gr[i] + wd * p[i];
    if (buf) {
      // PyTorch seeds the buffer with the first gradient itself, undamped.
      buf[i] = first_step ? g : mom * buf[i] + damp * g;
      g = nesterov ? g + mom * buf[i] : buf[i];
    }
    p[i] -= lr_t * g;
  }
}

// `scale` (or nullptr): every gradient element multiplied by it as it is
// read, in double and rounded to T -- scale_multi's arithmetic (cpu/
// multi_tensor.cpp), so the update equals that of gradients scaled in place.
template <typename T>
void adamw_loop(const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
                const double* scale = nullptr) {
  const double bias1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  const T decay = static_cast<T>(1.0 - lr * weight_decay);
  const T step_size = static_cast<T>(lr / bias1);
  const T bias2_sqrt = static_cast<T>(std::sqrt(bias2));
  const T b1 = static_cast<T>(beta1), b2 = static_cast<T>(beta2);
  const T one_b1 = static_cast<T>(1.0 - beta1), one_b2 = static_cast<T>(1.0 - beta2);
  const T eps_t = static_cast<T>(eps);
  T* p = param.data<T>();
  const T* gr = grad.data<T>();
  T* m = exp_avg.data<T>();
  T* v = exp_avg_sq.data<T>();
  const int64_t n = param.numel();
  for (int64_t i = 0; i < n; ++i) {
    const T g = scale ? static_cast<T>(static_cast<double>(gr[i]) * *scale) : gr[i];
    p[i] *= decay;
    m[i] = b1 * m[i] + one_b1 * g;
    v[i] = b2 * v[i] + one_b2 * g * g;
    p[i] -= step_size * m[i] / (std::sqrt(v[i]) / bias2_sqrt + eps_t);
  }
}

// addends: empty, or one per parameter (undefined where none), each of its
// gradient's dtype and shape, contiguous.
void check_addends(const char* op, const TensorList& params, const TensorList& grads, const TensorList& addends) {
  CHORUS_CHECK(addends.empty() || addends.size() == params.size(), op, ": ", params.size(), " parameters but ",
               addends.size(), " addends");
  for (size_t i = 0; i < addends.size(); ++i)
    if (addends[i].defined()) check_state(op, "addend", addends[i], grads[i]);
}

// grads[i] + addends[i] in the gradient's dtype (one addition per element, as
// the CUDA kernels do it), or grads[i] where there is no addend.
Tensor with_addend(const TensorList& grads, const TensorList& addends, size_t i) {
  if (addends.empty() || !addends[i].defined()) return grads[i];
  Tensor sum = detail::empty_tensor(grads[i].sizes(), grads[i].dtype(), grads[i].device());
  const int64_t n = sum.numel();
  auto add = [&]<typename T>() {
    const T* a = grads[i].data<T>();
    const T* b = addends[i].data<T>();
    T* out = sum.data<T>();
    for (int64_t k = 0; k < n; ++k) out[k] = a[k] + b[k];
  };
  if (sum.dtype() == kFloat64) add.template operator()<double>();
  else add.template operator()<float>();
  return sum;
}

}  // namespace

void sgd_update(const Tensor& param, const Tensor& grad, const Tensor& momentum_buf, double lr,
                double momentum, double dampening, double weight_decay, bool nesterov,
                bool first_step) {
  const char* op = "sgd_update";
  check_state(op, "param", param, param);
  check_state(op, "grad", grad, param);
  if (momentum != 0) check_state(op, "momentum_buf", momentum_buf, param);
  if (param.dtype() == kFloat64)
    sgd_loop<double>(param, grad, momentum_buf, lr, momentum, dampening, weight_decay, nesterov, first_step);
  else
    sgd_loop<float>(param, grad, momentum_buf, lr, momentum, dampening, weight_decay, nesterov, first_step);
}

void sgd_update_multi(const TensorList& params, const TensorList& grads,
                      const TensorList& momentum_bufs, double lr, double momentum,
                      double dampening, double weight_decay, bool nesterov, bool first_step,
                      const Tensor& scalars, const TensorList& copies, const TensorList& addends) {
  if (scalars.defined()) lr = scalars.data<float>()[0];
  CHORUS_CHECK(grads.size() == params.size() && momentum_bufs.size() == params.size(),
               "sgd_update_multi: ", params.size(), " parameters but ", grads.size(),
               " gradients and ", momentum_bufs.size(), " momentum buffers");
  check_addends("sgd_update_multi", params, grads, addends);
  CHORUS_CHECK(copies.empty() || copies.size() == params.size(), "sgd_update_multi: ", params.size(),
               " parameters but ", copies.size(), " copies");
  for (size_t i = 0; i < params.size(); ++i) {
    sgd_update(params[i], with_addend(grads, addends, i), momentum_bufs[i], lr, momentum, dampening,
               weight_decay, nesterov, first_step);
    if (!copies.empty() && copies[i].defined()) copy(params[i], copies[i]);
  }
}

namespace {

void adamw_one(const char* op, const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
               const Tensor& exp_avg_sq, double lr, double beta1, double beta2, double eps, double weight_decay,
               int64_t step, const double* scale) {
  check_state(op, "param", param, param);
  check_state(op, "grad", grad, param);
  check_state(op, "exp_avg", exp_avg, param);
  check_state(op, "exp_avg_sq", exp_avg_sq, param);
  CHORUS_CHECK(step >= 1, op, ": step counts from 1, got ", step);
  if (param.dtype() == kFloat64)
    adamw_loop<double>(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step, scale);
  else
    adamw_loop<float>(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step, scale);
}

}  // namespace

void adamw_update(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                  const Tensor& exp_avg_sq, double lr, double beta1, double beta2, double eps,
                  double weight_decay, int64_t step) {
  adamw_one("adamw_update", param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step, nullptr);
}

void adamw_update_multi(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                        const TensorList& exp_avg_sqs, double lr, double beta1, double beta2, double eps,
                        double weight_decay, int64_t step, const Tensor& scalars, const TensorList& addends,
                        const Tensor& grad_scale, const TensorList& copies) {
  CHORUS_CHECK(copies.empty() || copies.size() == params.size(), "adamw_update_multi: ", params.size(),
               " parameters but ", copies.size(), " copies");
  if (scalars.defined()) {
    lr = scalars.data<float>()[0];
    step = static_cast<int64_t>(scalars.data<float>()[1]);
  }
  CHORUS_CHECK(grads.size() == params.size() && exp_avgs.size() == params.size() &&
                   exp_avg_sqs.size() == params.size(),
               "adamw_update_multi: ", params.size(), " parameters but ", grads.size(), " gradients, ",
               exp_avgs.size(), " exp_avg and ", exp_avg_sqs.size(), " exp_avg_sq");
  check_addends("adamw_update_multi", params, grads, addends);
  double scale = 1;
  if (grad_scale.defined()) {
    CHORUS_CHECK(grad_scale.numel() == 1 && (grad_scale.dtype() == kFloat32 || grad_scale.dtype() == kFloat64) &&
                     grad_scale.device().is_cpu(),
                 "adamw_update_multi: the gradient scale must be one float32 or float64 element on the CPU, got ",
                 grad_scale.describe());
    scale = grad_scale.dtype() == kFloat64 ? grad_scale.data<double>()[0]
                                           : static_cast<double>(grad_scale.data<float>()[0]);
  }
  for (size_t i = 0; i < params.size(); ++i) {
    adamw_one("adamw_update_multi", params[i], with_addend(grads, addends, i), exp_avgs[i], exp_avg_sqs[i], lr,
              beta1, beta2, eps, weight_decay, step, grad_scale.defined() ? &scale : nullptr);
    if (!copies.empty() && copies[i].defined()) copy(params[i], copies[i]);
  }
}

}  // namespace chorus::cpu
