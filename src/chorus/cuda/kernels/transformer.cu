// The transformer's row-wise kernels on CUDA besides layer norm (which
// layer_norm_forward.cu and layer_norm_backward.cu hold): attention's (causal) softmax and the fused classifier
// + cross entropy (as cpu/transformer.cpp, float math throughout), and the
// classifier gradient's scale. Rows are laid out over warps or blocks as
// cuda/kernels/row_reduce.cuh says.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "chorus/cuda/runtime/context.h"
#include "chorus/cuda/kernels/dtype_dispatch.cuh"
#include "chorus/cuda/kernels/kernels.h"
#include "chorus/cuda/kernels/row_reduce.cuh"
#include "chorus/cuda/kernels/tensor_iter.cuh"

namespace chorus::cuda {

namespace {

// Query i of a [T, S] block sees keys 0 .. i + (S - T).
__device__ __forceinline__ int64_t visible_cols(int64_t row, int64_t t, int64_t s, bool causal) {
  return causal ? (row % t) + (s - t) + 1 : s;
}

// Attention's softmax a row at a time, V elements per 16-byte access (a row of
// S = 1024 bf16 scores is 128 vectors: 4 per lane of its warp). Causal rows
// read only the vectors that hold visible columns and write zeros past them
// without reading: half of the scores of a square mask are never read.
template <typename T, int V>
__global__ void attention_softmax_forward_kernel(const T* x, T* y, int64_t rows, int64_t t, int64_t s, float scale,
                                                 bool causal) {
  const int64_t row = row_index();
  if (row >= rows) return;
  const int64_t vis = visible_cols(row, t, s, causal);
  const int64_t nv = s / V, vis_v = (vis + V - 1) / V;
  const Vec<T, V>* xr = reinterpret_cast<const Vec<T, V>*>(x + row * s);
  Vec<T, V>* yr = reinterpret_cast<Vec<T, V>*>(y + row * s);
  MaxSumV ms{-INFINITY, 0.0f};
  for (int64_t c = threadIdx.x; c < vis_v; c += blockDim.x) {
    const Vec<T, V> v = xr[c];
#pragma unroll
    for (int j = 0; j < V; ++j)
      if (c * V + j < vis) ms = ms.add(to_acc(v.v[j]) * scale);
  }
  ms = row_allreduce(ms);
  const float inv = 1.0f / ms.s;
  for (int64_t c = threadIdx.x; c < nv; c += blockDim.x) {
    Vec<T, V> out;
    if (c < vis_v) {
      const Vec<T, V> v = xr[c];
#pragma unroll
      for (int j = 0; j < V; ++j)
        out.v[j] = convert<T>(c * V + j < vis ? expf(to_acc(v.v[j]) * scale - ms.m) * inv : 0.0f);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) out.v[j] = convert<T>(0.0f);
    }
    yr[c] = out;
  }
}

// dx = scale * y * (dy - sum(dy * y)); past the visible columns y = 0, so dx = 0 unread.
template <typename T, int V>
__global__ void attention_softmax_backward_kernel(const T* dy, const T* y, T* dx, int64_t rows, int64_t t, int64_t s,
                                                  float scale, bool causal) {
  const int64_t row = row_index();
  if (row >= rows) return;
  const int64_t vis = visible_cols(row, t, s, causal);
  const int64_t nv = s / V, vis_v = (vis + V - 1) / V;
  const Vec<T, V>* gr = reinterpret_cast<const Vec<T, V>*>(dy + row * s);
  const Vec<T, V>* pr = reinterpret_cast<const Vec<T, V>*>(y + row * s);
  Vec<T, V>* dr = reinterpret_cast<Vec<T, V>*>(dx + row * s);
  SumV dot{0.0f};
  for (int64_t c = threadIdx.x; c < vis_v; c += blockDim.x) {
    const Vec<T, V> g = gr[c], p = pr[c];
#pragma unroll
    for (int j = 0; j < V; ++j) dot.s += to_acc(g.v[j]) * to_acc(p.v[j]);
  }
  dot = row_allreduce(dot);
  for (int64_t c = threadIdx.x; c < nv; c += blockDim.x) {
    Vec<T, V> out;
    if (c < vis_v) {
      const Vec<T, V> g = gr[c], p = pr[c];
#pragma unroll
      for (int j = 0; j < V; ++j) out.v[j] = convert<T>(scale * to_acc(p.v[j]) * (to_acc(g.v[j]) - dot.s));
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) out.v[j] = convert<T>(0.0f);
    }
    dr[c] = out;
  }
}

// A 16-byte (or smaller) vector stored with the evict-first hint (st.global.cs).
template <typename T, int V>
__device__ __forceinline__ void store_streaming(Vec<T, V>* p, const Vec<T, V>& v) {
  if constexpr (sizeof(Vec<T, V>) == 16) {
    __stcs(reinterpret_cast<int4*>(p), *reinterpret_cast<const int4*>(&v));
  } else if constexpr (sizeof(Vec<T, V>) == 8) {
    __stcs(reinterpret_cast<int2*>(p), *reinterpret_cast<const int2*>(&v));
  } else if constexpr (sizeof(Vec<T, V>) == 4) {
    __stcs(reinterpret_cast<int*>(p), *reinterpret_cast<const int*>(&v));
  } else {
    *p = v;
  }
}

// Note [The classifier's exponentials]: the row's max and sum of exp(x - max)
// a 16-byte vector at a time -- the sum rescaled once per vector whose max is
// new, not per element -- with the hardware's exp2 (__expf: ex2.approx of
// x log2 e, ~2 ulp, ~1e-6 relative at the arguments a softmax sees) instead
// of expf's longer accurate sequence. Both passes over the row were bound by
// the exponentials, not by the memory (llm.c builds its classifier with
// --use_fast_math for the same reason). A NaN logit makes the sum NaN (the
// row's loss NaN, as in PyTorch). Vector c holds columns c V .. c V + V - 1
// (32-bit: a row has fewer than 2^31 columns).
template <typename T, int V>
__device__ __forceinline__ void max_sum_add(MaxSumV& ms, const Vec<T, V>& v, int c, int valid) {
  float x[V];
  float vm = -INFINITY;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    x[j] = c * V + j < valid ? static_cast<float>(to_acc(v.v[j])) : -INFINITY;
    vm = fmaxf(vm, x[j]);
  }
  if (vm == -INFINITY) {
    // Every element -inf (or NaN, which fmaxf passes over): only a NaN counts.
#pragma unroll
    for (int j = 0; j < V; ++j)
      if (x[j] != x[j]) ms.s = x[j];
    return;
  }
  if (vm > ms.m) {
    ms.s = ms.m == -INFINITY ? 0.0f : ms.s * __expf(ms.m - vm);
    ms.m = vm;
  }
#pragma unroll
  for (int j = 0; j < V; ++j) ms.s += __expf(x[j] - ms.m);
}

// The gradient of vector c: (softmax - onehot(tg)) * scale over the first
// `valid` columns, 0 past them.
template <typename T, int V>
__device__ __forceinline__ Vec<T, V> cross_entropy_grad(const Vec<T, V>& v, int c, int valid, int64_t tg,
                                                        float m, float log_sum, float scale) {
  Vec<T, V> out;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int col = c * V + j;
    const float g = col < valid ? (__expf((to_acc(v.v[j]) - m) - log_sum) - (col == tg ? 1.0f : 0.0f)) * scale : 0.0f;
    out.v[j] = convert<T>(g);
  }
  return out;
}

template <typename T, int V>
__device__ __forceinline__ Vec<T, V> zero_vec() {
  Vec<T, V> zero;
#pragma unroll
  for (int j = 0; j < V; ++j) zero.v[j] = convert<T>(0.0f);
  return zero;
}

// One row of the fused classifier: loss = lse - x[t], dlogits = softmax - onehot
// over the first `valid` columns, 0 past them and on ignored rows.
// V elements per 16-byte access: two reads of the row (the second mostly
// from L2) and one write.
//
// Note [The classifier's cache order]: the second read of a row hits the
// cache only if the row is still there, so, as llm.c's classifier does, (1)
// blocks take the rows last to first -- the logits' product wrote the last
// rows last, some of them are still in L2 when this kernel starts; (2) the
// first pass walks a row from its end to its start, so the second pass, from
// the start, begins on the most recently read vectors; (3) the gradient is
// stored evict-first (st.global.cs): written once and read by the next
// product, it should not push out logits not yet read a second time.
template <typename T, typename L, int V>
__global__ void cross_entropy_fused_kernel(const T* logits, const int64_t* target, int64_t rows, int64_t cols,
                                           int64_t valid, int64_t ignore_index, L* losses, T* dlogits,
                                           const float* grad_scale) {
  const int64_t ri = row_index();
  if (ri >= rows) return;
  const int64_t row = rows - 1 - ri;
  const float scale = grad_scale ? *grad_scale : 1.0f;
  const int64_t tg = target[row];
  const int64_t nv = cols / V, valid_v = (valid + V - 1) / V;
  const int64_t bd = blockDim.x;
  const Vec<T, V>* xr = reinterpret_cast<const Vec<T, V>*>(logits + row * cols);
  Vec<T, V>* dr = reinterpret_cast<Vec<T, V>*>(dlogits + row * cols);
  if (tg == ignore_index) {
    for (int64_t c = threadIdx.x; c < nv; c += bd) dr[c] = zero_vec<T, V>();
    if (threadIdx.x == 0) losses[row] = L(0);
    return;
  }
  MaxSumV ms{-INFINITY, 0.0f};
  // Four vectors loaded before any is summed: more bytes in flight per
  // thread (the same order of sums as one at a time).
  int64_t c = valid_v - 1 - threadIdx.x;
  for (; c - 3 * bd >= 0; c -= 4 * bd) {
    const Vec<T, V> a = xr[c], b = xr[c - bd], d = xr[c - 2 * bd], e = xr[c - 3 * bd];
    max_sum_add(ms, a, static_cast<int>(c), static_cast<int>(valid));
    max_sum_add(ms, b, static_cast<int>(c - bd), static_cast<int>(valid));
    max_sum_add(ms, d, static_cast<int>(c - 2 * bd), static_cast<int>(valid));
    max_sum_add(ms, e, static_cast<int>(c - 3 * bd), static_cast<int>(valid));
  }
  for (; c >= 0; c -= bd) max_sum_add(ms, xr[c], static_cast<int>(c), static_cast<int>(valid));
  ms = row_allreduce(ms);
  const float log_sum = logf(ms.s);
  // The target's logit is read before any thread overwrites the row (dlogits may alias logits).
  const float x_t = (tg >= 0 && tg < valid) ? to_acc(logits[row * cols + tg]) : NAN;
  __syncwarp();
  if (blockDim.x > 32) __syncthreads();
  auto grad = [&](const Vec<T, V>& v, int64_t k) {
    return k < valid_v ? cross_entropy_grad(v, static_cast<int>(k), static_cast<int>(valid), tg, ms.m, log_sum, scale)
                       : zero_vec<T, V>();
  };
  // Two vectors read before either is written (each thread writes only
  // the vectors it read, so dlogits aliasing logits is safe).
  c = threadIdx.x;
  for (; c + bd < nv; c += 2 * bd) {
    const Vec<T, V> a = xr[c], b = xr[c + bd];
    store_streaming(dr + c, grad(a, c));
    store_streaming(dr + c + bd, grad(b, c + bd));
  }
  for (; c < nv; c += bd) store_streaming(dr + c, grad(xr[c], c));
  // An out-of-range target gives a NaN loss rather than a read out of bounds.
  if (threadIdx.x == 0) losses[row] = L(-((x_t - ms.m) - log_sum));
}

}  // namespace

void attention_softmax_forward(const Tensor& x, double scale, bool causal, const Tensor& y) {
  const char* op = "attention_softmax_forward";
  check_cuda_contiguous(x, op, "x");
  check_cuda_contiguous(y, op, "y");
  CHORUS_CHECK(x.dim() == 3 && x.sizes() == y.sizes() && x.dtype() == y.dtype(), op,
               ": x and y must be one [batch, T, S] shape and dtype, got ", x.describe(), ", ", y.describe());
  const int64_t t = x.size(1), s = x.size(2), rows = x.size(0) * t;
  CHORUS_CHECK(!causal || s >= t, op, ": a causal mask needs S >= T, got ", x.describe());
  if (rows == 0 || s == 0) return;
  const int dev = x.device().index;
  CudaDeviceGuard guard(dev);
  const RowLaunch l = row_launch(rows, s);
  dispatch_float(x.dtype(), op, [&]<typename T>() {
    with_row_vector<T>(s, {x.raw_data(), y.raw_data()}, [&]<int V>() {
      attention_softmax_forward_kernel<T, V><<<l.grid, l.block, 0, current_stream(dev)>>>(
          x.data<T>(), y.data<T>(), rows, t, s, static_cast<float>(scale), causal);
    });
  });
  CHORUS_CUDA_LAUNCH_CHECK();
}

void attention_softmax_backward(const Tensor& dy, const Tensor& y, double scale, bool causal, const Tensor& dx) {
  const char* op = "attention_softmax_backward";
  check_cuda_contiguous(y, op, "y");
  check_cuda_contiguous(dy, op, "dy");
  check_cuda_contiguous(dx, op, "dx");
  CHORUS_CHECK(y.dim() == 3 && dy.sizes() == y.sizes() && dx.sizes() == y.sizes() && dy.dtype() == y.dtype() &&
                   dx.dtype() == y.dtype(),
               op, ": dy, y and dx must be one [batch, T, S] shape and dtype");
  const int64_t t = y.size(1), s = y.size(2), rows = y.size(0) * t;
  if (rows == 0 || s == 0) return;
  const int dev = y.device().index;
  CudaDeviceGuard guard(dev);
  const RowLaunch l = row_launch(rows, s);
  dispatch_float(y.dtype(), op, [&]<typename T>() {
    with_row_vector<T>(s, {dy.raw_data(), y.raw_data(), dx.raw_data()}, [&]<int V>() {
      attention_softmax_backward_kernel<T, V><<<l.grid, l.block, 0, current_stream(dev)>>>(
          dy.data<T>(), y.data<T>(), dx.data<T>(), rows, t, s, static_cast<float>(scale), causal);
    });
  });
  CHORUS_CUDA_LAUNCH_CHECK();
}

void cross_entropy_fused(const Tensor& logits, const Tensor& target, int64_t valid_cols, int64_t ignore_index,
                         const Tensor& losses, const Tensor& dlogits, const Tensor& grad_scale) {
  const char* op = "cross_entropy_fused";
  check_cuda_contiguous(logits, op, "logits");
  check_cuda_contiguous(dlogits, op, "dlogits");
  check_cuda_contiguous(target, op, "target");
  CHORUS_CHECK(logits.dim() == 2 && dlogits.sizes() == logits.sizes() && dlogits.dtype() == logits.dtype(), op,
               ": logits and dlogits must be one [rows, vocabulary] shape and dtype");
  const int64_t rows = logits.size(0), cols = logits.size(1);
  CHORUS_CHECK(target.dtype() == kInt64 && target.sizes() == Shape{rows}, op, ": target must be int64 [", rows,
               "], got ", target.describe());
  CHORUS_CHECK(losses.dtype() == kFloat32 && losses.sizes() == Shape{rows}, op, ": losses must be float32 [", rows,
               "]");
  CHORUS_CHECK(valid_cols >= 1 && valid_cols <= cols, op, ": valid_cols ", valid_cols, " must be in [1, ", cols, "]");
  CHORUS_CHECK(!grad_scale.defined() || (grad_scale.numel() == 1 && grad_scale.dtype() == kFloat32 &&
                                         grad_scale.device() == logits.device()),
               op, ": grad_scale must be one float32 on ", logits.device().str(), ", got ", grad_scale.describe());
  if (rows == 0) return;
  const int dev = logits.device().index;
  CudaDeviceGuard guard(dev);
  // 256 threads a row (row_launch's): 1024, as llm.c's classifier, measured
  // slower here, in session 36 and again with the cache order and the fast
  // exponentials (session 40: gpt2 499.5k against 506.2k tok/s, one H200). A
  // block of 768 threads holding its whole row in registers (one read of the
  // logits, not two) was slower still: 2.11 against 1.41 ms a gpt2 step
  // (benchmarks journal, session 40).
  // Fewer rows in flight, so that a row is still in L2 for its second read (a
  // gpt2 row is 50304 bf16 logits, 98 KiB; a block a row keeps 5 blocks of
  // 256 threads on each SM, ~65 MiB of rows against H200's 50 MiB of L2), was
  // slower too: k blocks an SM walking the rows with a stride took 1.80, 1.54
  // and 1.48 ms at k = 2, 3, 4 against 1.31 ms (gpt2 on one H200, benchmarks
  // journal, session 41) -- fewer rows at once leave the memory idle while
  // each block reduces and exponentiates, as the register-resident row did.
  const RowLaunch l = row_launch(rows, cols);
  const float* scale_ptr = grad_scale.defined() ? grad_scale.data<float>() : nullptr;
  dispatch_float(logits.dtype(), op, [&]<typename T>() {
    with_row_vector<T>(cols, {logits.raw_data(), dlogits.raw_data()}, [&]<int V>() {
      cross_entropy_fused_kernel<T, float, V><<<l.grid, l.block, 0, current_stream(dev)>>>(
          logits.data<T>(), target.data<int64_t>(), rows, cols, valid_cols, ignore_index, losses.data<float>(),
          dlogits.data<T>(), scale_ptr);
    });
  });
  CHORUS_CUDA_LAUNCH_CHECK();
}

namespace {

// Each block reads the scale and leaves at once when it is 1 (Note [The
// classifier's gradient scaled once] in autograd/transformer_functions.cpp).
template <typename T, typename S>
__global__ void scale_unless_one_kernel(T* x, int64_t n, const S* scale) {
  const S s = *scale;
  if (s == S(1)) return;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    x[i] = convert<T>(static_cast<S>(to_acc(x[i])) * s);
}

}  // namespace

void scale_unless_one(const Tensor& x, const Tensor& scale) {
  const char* op = "scale_unless_one";
  check_cuda_contiguous(x, op, "x");
  CHORUS_CHECK(scale.defined() && scale.numel() == 1 && scale.device() == x.device() &&
                   (scale.dtype() == kFloat32 || scale.dtype() == kFloat64),
               op, ": scale must be one float32 or float64 on ", x.device().str(), ", got ", scale.describe());
  const int64_t n = x.numel();
  if (n == 0) return;
  const int dev = x.device().index;
  CudaDeviceGuard guard(dev);
  constexpr int kThreads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 4096));
  dispatch_float(x.dtype(), op, [&]<typename T>() {
    if (scale.dtype() == kFloat64) {
      scale_unless_one_kernel<T, double><<<blocks, kThreads, 0, current_stream(dev)>>>(x.data<T>(), n,
                                                                                       scale.data<double>());
    } else {
      scale_unless_one_kernel<T, float><<<blocks, kThreads, 0, current_stream(dev)>>>(x.data<T>(), n,
                                                                                     scale.data<float>());
    }
  });
  CHORUS_CUDA_LAUNCH_CHECK();
}

}  // namespace chorus::cuda
