// Fused optimizer updates of the CUDA kernel set: one pass over parameter,
// gradient and state, in float32, with PyTorch's update rules.
#include <cmath>
#include <cstdint>

#include "chorus/cuda/context.h"
#include "chorus/cuda/kernels.h"
#include "chorus/cuda/tensor_iter.cuh"

namespace chorus::cuda {

namespace {

// Scalars are rounded to float once on the host, as cpu/optim_kernels.cpp
// does, so both devices run the same float arithmetic.
struct SgdParams {
  float lr, momentum, one_minus_dampening, weight_decay;
  bool nesterov, first_step, has_momentum;
};

// g = grad + wd * param
// momentum: buf = first_step ? g : momentum * buf + (1 - dampening) * g
//           g = nesterov ? g + momentum * buf : buf
// param -= lr * g
__global__ void sgd_kernel(float* param, const float* grad, float* buf, int64_t n, SgdParams p) {
  for (int64_t i = global_thread_id(); i < n; i += grid_stride()) {
    float g = grad[i] + p.weight_decay * param[i];
    if (p.has_momentum) {
      const float b = p.first_step ? g : p.momentum * buf[i] + p.one_minus_dampening * g;
      buf[i] = b;
      g = p.nesterov ? g + p.momentum * b : b;
    }
    param[i] -= p.lr * g;
  }
}

struct AdamWParams {
  float decay;       // 1 - lr * wd
  float step_size;   // lr / (1 - beta1^step)
  float bias2_sqrt;  // sqrt(1 - beta2^step)
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps;
};

// PyTorch's AdamW:
//   param *= 1 - lr * wd
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   param -= lr / (1 - b1^step) * m / (sqrt(v) / sqrt(1 - b2^step) + eps)
// which is lr * m_hat / (sqrt(v_hat) + eps) with the bias corrections folded in.
__global__ void adamw_kernel(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                             int64_t n, AdamWParams p) {
  for (int64_t i = global_thread_id(); i < n; i += grid_stride()) {
    const float g = grad[i];
    const float m = p.beta1 * exp_avg[i] + p.one_minus_beta1 * g;
    const float v = p.beta2 * exp_avg_sq[i] + p.one_minus_beta2 * g * g;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    param[i] = param[i] * p.decay - p.step_size * m / (sqrtf(v) / p.bias2_sqrt + p.eps);
  }
}

void check_state(const Tensor& param, const Tensor& t, const char* op, const char* what) {
  CHORUS_CHECK(t.dtype() == kFloat32 && t.is_contiguous() && t.device() == param.device() &&
                   t.numel() == param.numel(),
               op, ": ", what, " must be a contiguous float32 tensor of ", param.numel(),
               " elements on ", param.device().str(), ", got ", t.describe());
}

}  // namespace

void sgd_update(const Tensor& param, const Tensor& grad, const Tensor& momentum_buf, double lr,
                double momentum, double dampening, double weight_decay, bool nesterov,
                bool first_step) {
  CHORUS_CHECK(param.device().is_cuda(), "sgd_update: expected a CUDA parameter, got ",
               param.describe());
  check_state(param, param, "sgd_update", "the parameter");
  check_state(param, grad, "sgd_update", "the gradient");
  const bool has_momentum = momentum != 0.0;
  if (has_momentum) check_state(param, momentum_buf, "sgd_update", "the momentum buffer");
  const int64_t n = param.numel();
  if (n == 0) return;
  const int dev = param.device().index;
  CudaDeviceGuard guard(dev);
  const SgdParams p{static_cast<float>(lr), static_cast<float>(momentum),
                    static_cast<float>(1.0 - dampening), static_cast<float>(weight_decay),
                    nesterov, first_step, has_momentum};
  sgd_kernel<<<grid_for(n), kThreads, 0, current_stream(dev)>>>(
      param.data<float>(), grad.data<float>(),
      has_momentum ? momentum_buf.data<float>() : nullptr, n, p);
  CHORUS_CUDA_LAUNCH_CHECK();
}

void adamw_update(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                  const Tensor& exp_avg_sq, double lr, double beta1, double beta2, double eps,
                  double weight_decay, int64_t step) {
  CHORUS_CHECK(param.device().is_cuda(), "adamw_update: expected a CUDA parameter, got ",
               param.describe());
  CHORUS_CHECK(step >= 1, "adamw_update: step counts from 1, got ", step);
  check_state(param, param, "adamw_update", "the parameter");
  check_state(param, grad, "adamw_update", "the gradient");
  check_state(param, exp_avg, "adamw_update", "exp_avg");
  check_state(param, exp_avg_sq, "adamw_update", "exp_avg_sq");
  const int64_t n = param.numel();
  if (n == 0) return;
  const int dev = param.device().index;
  CudaDeviceGuard guard(dev);
  const double bias1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  const AdamWParams p{static_cast<float>(1.0 - lr * weight_decay),
                      static_cast<float>(lr / bias1),
                      static_cast<float>(std::sqrt(bias2)),
                      static_cast<float>(beta1),
                      static_cast<float>(beta2),
                      static_cast<float>(1.0 - beta1),
                      static_cast<float>(1.0 - beta2),
                      static_cast<float>(eps)};
  adamw_kernel<<<grid_for(n), kThreads, 0, current_stream(dev)>>>(
      param.data<float>(), grad.data<float>(), exp_avg.data<float>(), exp_avg_sq.data<float>(), n,
      p);
  CHORUS_CUDA_LAUNCH_CHECK();
}

}  // namespace chorus::cuda
