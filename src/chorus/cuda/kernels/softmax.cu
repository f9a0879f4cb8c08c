// Softmax, log-softmax and cross entropy of the CUDA kernel set: row-wise over
// the last dim of a contiguous [rows, cols] tensor, float math throughout.
//
// Rows are laid out over warps or blocks as cuda/kernels/row_reduce.cuh says. The
// forward passes find the row max and the sum of exp(x - max) together in one
// read (the "online" softmax), then write in a second read.
#include <cmath>
#include <cstdint>

#include "chorus/cuda/runtime/context.h"
#include "chorus/cuda/kernels/dtype_dispatch.cuh"
#include "chorus/cuda/kernels/kernels.h"
#include "chorus/cuda/kernels/row_reduce.cuh"
#include "chorus/cuda/kernels/tensor_iter.cuh"

namespace chorus::cuda {

namespace {

template <typename T>
__global__ void softmax_forward_kernel(const T* x, T* y, int64_t rows, int64_t cols, bool log) {
  const int64_t row = row_index();
  if (row >= rows) return;  // a whole warp (or block) at once
  const T* xr = x + row * cols;
  T* yr = y + row * cols;
  MaxSumV ms{-INFINITY, 0.0f};
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) ms = ms.add(to_acc(xr[c]));
  ms = row_allreduce(ms);
  const float log_sum = logf(ms.s), inv_sum = 1.0f / ms.s;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float v = to_acc(xr[c]) - ms.m;
    yr[c] = convert<T>(log ? v - log_sum : expf(v) * inv_sum);
  }
}

template <typename T>
__global__ void softmax_backward_kernel(const T* dy, const T* y, T* dx, int64_t rows, int64_t cols,
                                        bool log) {
  const int64_t row = row_index();
  if (row >= rows) return;
  const int64_t base = row * cols;
  SumV sum{0.0f};
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float g = to_acc(dy[base + c]);
    sum.s += log ? g : g * to_acc(y[base + c]);
  }
  sum = row_allreduce(sum);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float g = to_acc(dy[base + c]), out = to_acc(y[base + c]);
    dx[base + c] = convert<T>(log ? g - expf(out) * sum.s : out * (g - sum.s));
  }
}

// logp = (x - max) - log(sum): shifting first keeps the sums accurate for
// large logits, as in the CPU kernel. loss = -keep * logp[t] - spread * sum(logp).
template <typename T>
__global__ void cross_entropy_forward_kernel(const T* logits, const int64_t* target, int64_t rows,
                                             int64_t cols, float keep, float spread, float* losses,
                                             float* probs) {
  const int64_t row = row_index();
  if (row >= rows) return;
  const T* xr = logits + row * cols;
  MaxSumV ms{-INFINITY, 0.0f};
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) ms = ms.add(to_acc(xr[c]));
  ms = row_allreduce(ms);
  const float log_sum = logf(ms.s);
  SumV sum_logp{0.0f};
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float logp = (to_acc(xr[c]) - ms.m) - log_sum;
    sum_logp.s += logp;
    probs[row * cols + c] = expf(logp);
  }
  sum_logp = row_allreduce(sum_logp);
  if (threadIdx.x == 0) {
    const int64_t t = target[row];
    // An out-of-range target gives a NaN loss rather than a read out of bounds.
    const float logp_t = (t >= 0 && t < cols) ? (to_acc(xr[t]) - ms.m) - log_sum : NAN;
    losses[row] = -keep * logp_t - spread * sum_logp.s;
  }
}

template <typename T>
__global__ void cross_entropy_backward_kernel(const float* dloss, const float* probs,
                                              const int64_t* target, int64_t rows, int64_t cols,
                                              float keep, float spread, T* dlogits) {
  const int64_t n = rows * cols;
  for (int64_t i = global_thread_id(); i < n; i += grid_stride()) {
    const int64_t row = i / cols, c = i - row * cols;
    const float dl = dloss[row];
    float g = dl * (probs[i] - spread);
    if (target[row] == c) g -= dl * keep;
    dlogits[i] = convert<T>(g);
  }
}

// keep = 1 - eps and spread = eps / C, rounded to float once, as on the CPU.
struct Smoothing {
  float keep, spread;
};
Smoothing smoothing_of(double eps, int64_t cols, const char* op) {
  CHORUS_CHECK(eps >= 0.0 && eps <= 1.0, op, ": label smoothing must be in [0, 1], got ", eps);
  return {static_cast<float>(1.0 - eps), static_cast<float>(eps / static_cast<double>(cols))};
}

struct RowsCols {
  int64_t rows, cols;
};
RowsCols rows_cols(const Tensor& t, const char* op) {
  CHORUS_CHECK(t.device().is_cuda(), op, ": expected a CUDA tensor, got ", t.describe());
  CHORUS_CHECK(t.is_contiguous(), op, ": expected a contiguous tensor, got ", t.describe());
  CHORUS_CHECK(t.dim() >= 1, op, ": expected at least one dim, got ", t.describe());
  const int64_t cols = t.sizes().back();
  return {cols == 0 ? 0 : t.numel() / cols, cols};
}

void check_like(const Tensor& a, const Tensor& b, const char* op) {
  CHORUS_CHECK(a.device() == b.device() && a.sizes() == b.sizes() && b.is_contiguous(), op,
               ": ", b.describe(), " does not match ", a.describe(), " (or is not contiguous)");
}

}  // namespace

void softmax_forward(const Tensor& x, const Tensor& y, bool log) {
  const RowsCols rc = rows_cols(x, "softmax");
  check_like(x, y, "softmax");
  CHORUS_CHECK(x.dtype() == y.dtype(), "softmax: dtypes differ: ", x.describe(), ", ", y.describe());
  if (rc.rows == 0 || rc.cols == 0) return;
  const int dev = x.device().index;
  CudaDeviceGuard guard(dev);
  const RowLaunch l = row_launch(rc.rows, rc.cols);
  dispatch_float(x.dtype(), "softmax", [&]<typename T>() {
    softmax_forward_kernel<T><<<l.grid, l.block, 0, current_stream(dev)>>>(
        x.data<T>(), y.data<T>(), rc.rows, rc.cols, log);
  });
  CHORUS_CUDA_LAUNCH_CHECK();
}

void softmax_backward(const Tensor& dy, const Tensor& y, const Tensor& dx, bool log) {
  const RowsCols rc = rows_cols(y, "softmax_backward");
  check_like(y, dy, "softmax_backward");
  check_like(y, dx, "softmax_backward");
  CHORUS_CHECK(dy.dtype() == y.dtype() && dx.dtype() == y.dtype(),
               "softmax_backward: dtypes differ: ", dy.describe(), ", ", y.describe(), ", ",
               dx.describe());
  if (rc.rows == 0 || rc.cols == 0) return;
  const int dev = y.device().index;
  CudaDeviceGuard guard(dev);
  const RowLaunch l = row_launch(rc.rows, rc.cols);
  dispatch_float(y.dtype(), "softmax_backward", [&]<typename T>() {
    softmax_backward_kernel<T><<<l.grid, l.block, 0, current_stream(dev)>>>(
        dy.data<T>(), y.data<T>(), dx.data<T>(), rc.rows, rc.cols, log);
  });
  CHORUS_CUDA_LAUNCH_CHECK();
}

void cross_entropy_forward(const Tensor& logits, const Tensor& target, double smoothing,
                           const Tensor& losses, const Tensor& probs) {
  const RowsCols rc = rows_cols(logits, "cross_entropy");
  CHORUS_CHECK(logits.dim() == 2, "cross_entropy: logits must be [B, C], got ", logits.describe());
  CHORUS_CHECK(target.dtype() == kInt64 && target.is_contiguous() && target.numel() == rc.rows &&
                   target.device() == logits.device(),
               "cross_entropy: target must be int64 [", rc.rows, "] on ", logits.device().str(),
               ", got ", target.describe());
  CHORUS_CHECK(losses.dtype() == kFloat32 && losses.is_contiguous() && losses.numel() == rc.rows &&
                   losses.device() == logits.device(),
               "cross_entropy: losses must be float32 [", rc.rows, "], got ", losses.describe());
  check_like(logits, probs, "cross_entropy");
  CHORUS_CHECK(probs.dtype() == kFloat32, "cross_entropy: probs must be float32, got ",
               probs.describe());
  const Smoothing sm = smoothing_of(smoothing, rc.cols, "cross_entropy");
  if (rc.rows == 0) return;
  const int dev = logits.device().index;
  CudaDeviceGuard guard(dev);
  const RowLaunch l = row_launch(rc.rows, rc.cols);
  dispatch_float(logits.dtype(), "cross_entropy", [&]<typename T>() {
    cross_entropy_forward_kernel<T><<<l.grid, l.block, 0, current_stream(dev)>>>(
        logits.data<T>(), target.data<int64_t>(), rc.rows, rc.cols, sm.keep, sm.spread,
        losses.data<float>(), probs.data<float>());
  });
  CHORUS_CUDA_LAUNCH_CHECK();
}

void cross_entropy_backward(const Tensor& dloss, const Tensor& probs, const Tensor& target,
                            double smoothing, const Tensor& dlogits) {
  const RowsCols rc = rows_cols(probs, "cross_entropy_backward");
  check_like(probs, dlogits, "cross_entropy_backward");
  CHORUS_CHECK(probs.dtype() == kFloat32 && dloss.dtype() == kFloat32 && dloss.is_contiguous() &&
                   dloss.numel() == rc.rows && dloss.device() == probs.device(),
               "cross_entropy_backward: probs and dloss must be float32, got ", probs.describe(),
               " and ", dloss.describe());
  CHORUS_CHECK(target.dtype() == kInt64 && target.is_contiguous() && target.numel() == rc.rows &&
                   target.device() == probs.device(),
               "cross_entropy_backward: target must be int64 [", rc.rows, "], got ",
               target.describe());
  const Smoothing sm = smoothing_of(smoothing, rc.cols, "cross_entropy_backward");
  const int64_t n = rc.rows * rc.cols;
  if (n == 0) return;
  const int dev = probs.device().index;
  CudaDeviceGuard guard(dev);
  dispatch_float(dlogits.dtype(), "cross_entropy_backward", [&]<typename T>() {
    cross_entropy_backward_kernel<T><<<grid_for(n), kThreads, 0, current_stream(dev)>>>(
        dloss.data<float>(), probs.data<float>(), target.data<int64_t>(), rc.rows, rc.cols,
        sm.keep, sm.spread, dlogits.data<T>());
  });
  CHORUS_CUDA_LAUNCH_CHECK();
}

}  // namespace chorus::cuda
