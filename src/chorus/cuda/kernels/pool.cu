// The kernel-set pooling on CUDA: max pooling (writing int64 indices within the
// input plane, h * W + w), average pooling (count_include_pad, PyTorch's
// default) and adaptive average pooling, forward and backward.
//
// Tensors may have any strides, so contiguous NCHW and channels-last (NHWC)
// both work; each kernel walks the tensor it writes in that tensor's memory
// order (channel fastest for channels-last) so that neighbouring threads touch
// neighbouring addresses. Math is in float for float32/bfloat16/float16.
//
// The backward kernels are gathers, as PyTorch's max_pool_backward_nchw: each
// input element sums the gradients of the output windows that contain it. So
// no atomics (bfloat16 has no fast atomicAdd), results are deterministic, and
// dx is written exactly once, which is the contract's "overwrite".
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "chorus/core/error.h"
#include "chorus/cuda/runtime/context.h"
#include "chorus/cuda/kernels/dtype_dispatch.cuh"
#include "chorus/cuda/kernels/kernels.h"

namespace chorus::cuda {

namespace {

// ---- device helpers ---------------------------------------------------------------------

// Sizes or strides of a 4-d [N,C,H,W] tensor.
struct Dims4 {
  int64_t n, c, h, w;
};

// Strided offset of [n, c, h, w].
__device__ __forceinline__ int64_t offset(const Dims4& s, int64_t n, int64_t c, int64_t h,
                                          int64_t w) {
  return n * s.n + c * s.c + h * s.h + w * s.w;
}

// Coordinates of the i-th element in memory order: (n, h, w, c) when
// channels_last, else (n, c, h, w).
__device__ __forceinline__ void unravel(int64_t i, const Dims4& size, bool channels_last,
                                        int64_t& n, int64_t& c, int64_t& h, int64_t& w) {
  if (channels_last) {
    c = i % size.c;
    i /= size.c;
    w = i % size.w;
    i /= size.w;
    h = i % size.h;
    n = i / size.h;
  } else {
    w = i % size.w;
    i /= size.w;
    h = i % size.h;
    i /= size.h;
    c = i % size.c;
    n = i / size.c;
  }
}

#define CHORUS_GRID_STRIDE_LOOP(i, total)                                                    \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (total); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

// Window geometry of a (non-adaptive) pooling.
struct Window {
  int64_t kh, kw, sh, sw, ph, pw;
};

// ---- kernels ------------------------------------------------------------------------------

template <typename T>
__global__ void max_pool_forward_kernel(const T* x, Dims4 xs, Dims4 xsize, T* y, Dims4 ys,
                                        Dims4 ysize, int64_t* idx, Dims4 is, Window win,
                                        bool channels_last, int64_t total) {
  CHORUS_GRID_STRIDE_LOOP(i, total) {
    int64_t n, c, oh, ow;
    unravel(i, ysize, channels_last, n, c, oh, ow);
    int64_t h0 = oh * win.sh - win.ph, w0 = ow * win.sw - win.pw;
    const int64_t h1 = min(h0 + win.kh, xsize.h), w1 = min(w0 + win.kw, xsize.w);
    h0 = max(h0, int64_t{0});
    w0 = max(w0, int64_t{0});
    float best = -INFINITY;
    int64_t best_index = h0 * xsize.w + w0;
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t w = w0; w < w1; ++w) {
        const float v = to_acc(x[offset(xs, n, c, h, w)]);
        if (v > best || isnan(v)) {  // NaN propagates, as in PyTorch
          best = v;
          best_index = h * xsize.w + w;
        }
      }
    y[offset(ys, n, c, oh, ow)] = convert<T>(best);
    idx[offset(is, n, c, oh, ow)] = best_index;
  }
}

// Range [*first, *last) of output positions whose window (size k, stride s,
// padding p) contains input position `i`.
__device__ __forceinline__ void covering(int64_t i, int64_t k, int64_t s, int64_t p, int64_t out,
                                         int64_t* first, int64_t* last) {
  const int64_t ip = i + p;
  *first = ip < k ? 0 : (ip - k) / s + 1;
  *last = min(ip / s + 1, out);
}

template <typename T>
__global__ void max_pool_backward_kernel(const T* dy, Dims4 dys, Dims4 ysize, const int64_t* idx,
                                         Dims4 is, T* dx, Dims4 dxs, Dims4 xsize, Window win,
                                         bool channels_last, int64_t total) {
  CHORUS_GRID_STRIDE_LOOP(i, total) {
    int64_t n, c, h, w;
    unravel(i, xsize, channels_last, n, c, h, w);
    int64_t oh0, oh1, ow0, ow1;
    covering(h, win.kh, win.sh, win.ph, ysize.h, &oh0, &oh1);
    covering(w, win.kw, win.sw, win.pw, ysize.w, &ow0, &ow1);
    const int64_t me = h * xsize.w + w;
    float g = 0.0f;
    for (int64_t oh = oh0; oh < oh1; ++oh)
      for (int64_t ow = ow0; ow < ow1; ++ow)
        if (idx[offset(is, n, c, oh, ow)] == me) g += to_acc(dy[offset(dys, n, c, oh, ow)]);
    dx[offset(dxs, n, c, h, w)] = convert<T>(g);
  }
}

// count_include_pad: the divisor counts padding but not the part of a window
// past the padded input (PyTorch's pool_size).
__device__ __forceinline__ int64_t avg_divisor(int64_t oh, int64_t ow, const Dims4& xsize,
                                               const Window& win) {
  const int64_t h0 = oh * win.sh - win.ph, w0 = ow * win.sw - win.pw;
  const int64_t h1 = min(h0 + win.kh, xsize.h + win.ph), w1 = min(w0 + win.kw, xsize.w + win.pw);
  return (h1 - h0) * (w1 - w0);
}

template <typename T>
__global__ void avg_pool_forward_kernel(const T* x, Dims4 xs, Dims4 xsize, T* y, Dims4 ys,
                                        Dims4 ysize, Window win, bool channels_last,
                                        int64_t total) {
  CHORUS_GRID_STRIDE_LOOP(i, total) {
    int64_t n, c, oh, ow;
    unravel(i, ysize, channels_last, n, c, oh, ow);
    const int64_t h0 = max(oh * win.sh - win.ph, int64_t{0});
    const int64_t w0 = max(ow * win.sw - win.pw, int64_t{0});
    const int64_t h1 = min(oh * win.sh - win.ph + win.kh, xsize.h);
    const int64_t w1 = min(ow * win.sw - win.pw + win.kw, xsize.w);
    float sum = 0.0f;
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t w = w0; w < w1; ++w) sum += to_acc(x[offset(xs, n, c, h, w)]);
    y[offset(ys, n, c, oh, ow)] =
        convert<T>(sum / static_cast<float>(avg_divisor(oh, ow, xsize, win)));
  }
}

template <typename T>
__global__ void avg_pool_backward_kernel(const T* dy, Dims4 dys, Dims4 ysize, T* dx, Dims4 dxs,
                                         Dims4 xsize, Window win, bool channels_last,
                                         int64_t total) {
  CHORUS_GRID_STRIDE_LOOP(i, total) {
    int64_t n, c, h, w;
    unravel(i, xsize, channels_last, n, c, h, w);
    int64_t oh0, oh1, ow0, ow1;
    covering(h, win.kh, win.sh, win.ph, ysize.h, &oh0, &oh1);
    covering(w, win.kw, win.sw, win.pw, ysize.w, &ow0, &ow1);
    float g = 0.0f;
    for (int64_t oh = oh0; oh < oh1; ++oh)
      for (int64_t ow = ow0; ow < ow1; ++ow)
        g += to_acc(dy[offset(dys, n, c, oh, ow)]) /
             static_cast<float>(avg_divisor(oh, ow, xsize, win));
    dx[offset(dxs, n, c, h, w)] = convert<T>(g);
  }
}

// Adaptive windows: output o of `out` covers input [floor(o*in/out), ceil((o+1)*in/out)).
__device__ __forceinline__ int64_t adaptive_start(int64_t o, int64_t in, int64_t out) {
  return (o * in) / out;
}
__device__ __forceinline__ int64_t adaptive_end(int64_t o, int64_t in, int64_t out) {
  return ((o + 1) * in + out - 1) / out;
}

template <typename T>
__global__ void adaptive_avg_forward_kernel(const T* x, Dims4 xs, Dims4 xsize, T* y, Dims4 ys,
                                            Dims4 ysize, bool channels_last, int64_t total) {
  CHORUS_GRID_STRIDE_LOOP(i, total) {
    int64_t n, c, oh, ow;
    unravel(i, ysize, channels_last, n, c, oh, ow);
    const int64_t h0 = adaptive_start(oh, xsize.h, ysize.h),
                  h1 = adaptive_end(oh, xsize.h, ysize.h);
    const int64_t w0 = adaptive_start(ow, xsize.w, ysize.w),
                  w1 = adaptive_end(ow, xsize.w, ysize.w);
    float sum = 0.0f;
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t w = w0; w < w1; ++w) sum += to_acc(x[offset(xs, n, c, h, w)]);
    y[offset(ys, n, c, oh, ow)] = convert<T>(sum / static_cast<float>((h1 - h0) * (w1 - w0)));
  }
}

template <typename T>
__global__ void adaptive_avg_backward_kernel(const T* dy, Dims4 dys, Dims4 ysize, T* dx, Dims4 dxs,
                                             Dims4 xsize, bool channels_last, int64_t total) {
  CHORUS_GRID_STRIDE_LOOP(i, total) {
    int64_t n, c, h, w;
    unravel(i, xsize, channels_last, n, c, h, w);
    // The outputs whose windows contain h are exactly [floor(h*OH/H), ceil((h+1)*OH/H)).
    const int64_t oh0 = adaptive_start(h, ysize.h, xsize.h),
                  oh1 = adaptive_end(h, ysize.h, xsize.h);
    const int64_t ow0 = adaptive_start(w, ysize.w, xsize.w),
                  ow1 = adaptive_end(w, ysize.w, xsize.w);
    float g = 0.0f;
    for (int64_t oh = oh0; oh < oh1; ++oh) {
      const int64_t kh = adaptive_end(oh, xsize.h, ysize.h) - adaptive_start(oh, xsize.h, ysize.h);
      for (int64_t ow = ow0; ow < ow1; ++ow) {
        const int64_t kw =
            adaptive_end(ow, xsize.w, ysize.w) - adaptive_start(ow, xsize.w, ysize.w);
        g += to_acc(dy[offset(dys, n, c, oh, ow)]) / static_cast<float>(kh * kw);
      }
    }
    dx[offset(dxs, n, c, h, w)] = convert<T>(g);
  }
}

// Global average pooling's backward (a 1x1 output) into a dense dx, NCHW or
// NHWC: every element is its plane's gradient over H*W. The general kernel
// above spends a dozen 64-bit divisions per element on window bounds, far
// longer than its 10 MB write takes for WRN-28-10's [128, 640, 8, 8] on an
// H200 (Nsight Compute; benchmarks journal, session 10).
template <typename T, typename I>
__global__ void global_avg_backward_kernel(const T* dy, int64_t dy_n, int64_t dy_c, T* dx, I c, I hw,
                                           bool channels_last, I total, float hw_f) {
  for (I i = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<I>(gridDim.x) * blockDim.x) {
    I n, ch;
    if (channels_last) {
      ch = i % c;
      n = i / (hw * c);
    } else {
      ch = (i / hw) % c;
      n = i / (hw * c);
    }
    dx[i] = convert<T>(to_acc(dy[int64_t{n} * dy_n + int64_t{ch} * dy_c]) / hw_f);
  }
}

// The channels-last case of global_avg_backward_kernel, kVec channels (one
// 16-byte store) a thread: one 2-byte store a thread ran far below the H100's
// bandwidth in a WRN-28-10 bf16 step (benchmarks journal, session 23).
// c % kVec == 0 and dx 16-byte aligned.
template <typename T, int kVec>
__global__ void global_avg_backward_nhwc_kernel(const T* dy, int64_t dy_n, int64_t dy_c, T* dx, int64_t c,
                                                int64_t hw, int64_t packs, float hw_f) {
  struct alignas(sizeof(T) * kVec) Pack {
    T v[kVec];
  };
  const int64_t row_packs = c / kVec;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < packs;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t ch = (i % row_packs) * kVec, n = i / (row_packs * hw);
    Pack out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) out.v[j] = convert<T>(to_acc(dy[n * dy_n + (ch + j) * dy_c]) / hw_f);
    reinterpret_cast<Pack*>(dx)[i] = out;
  }
}

// ---- host side ------------------------------------------------------------------------------

Dims4 sizes_of(const Tensor& t) { return {t.size(0), t.size(1), t.size(2), t.size(3)}; }
Dims4 strides_of(const Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2), t.stride(3)}; }

// Whether to walk `t` channel-fastest (it is channels-last).
bool walk_channels_last(const Tensor& t) { return t.size(1) > 1 && t.stride(1) == 1; }

struct Launch {
  int64_t total;
  unsigned blocks;
  cudaStream_t stream;
};
constexpr unsigned kBlockThreads = 256;

Launch launch_for(const Tensor& walked) {
  const int64_t total = walked.numel();
  const int64_t blocks =
      std::min<int64_t>((total + kBlockThreads - 1) / kBlockThreads, int64_t{1} << 20);
  return {total, static_cast<unsigned>(std::max<int64_t>(blocks, 1)),
          current_stream(walked.device().index)};
}

void check_4d(const char* op, const Tensor& t, const char* name) {
  CHORUS_CHECK(t.dim() == 4, op, ": '", name, "' must be 4-d [N, C, H, W], got ", t.describe());
}

void check_pool(const char* op, const Pool2dGeometry& g, const Tensor& x, const char* x_name,
                const Tensor& y, const char* y_name) {
  check_4d(op, x, x_name);
  check_4d(op, y, y_name);
  CHORUS_CHECK(g.kh > 0 && g.kw > 0 && g.stride_h > 0 && g.stride_w > 0 && g.pad_h >= 0 &&
                   g.pad_w >= 0 && 2 * g.pad_h <= g.kh && 2 * g.pad_w <= g.kw,
               op, ": bad window: kernel ", g.kh, "x", g.kw, ", stride ", g.stride_h, "x",
               g.stride_w, ", padding ", g.pad_h, "x", g.pad_w,
               " (padding must be at most half the kernel)");
  const Shape xs{g.n, g.c, g.h, g.w}, ys{g.n, g.c, g.out_h(), g.out_w()};
  CHORUS_CHECK(x.sizes() == xs && y.sizes() == ys, op, ": expected ", x_name, " ", shape_str(xs),
               " and ", y_name, " ", shape_str(ys), ", got ", x.describe(), " and ", y.describe());
  CHORUS_CHECK(x.dtype() == y.dtype(), op, ": '", x_name, "' and '", y_name,
               "' must share one dtype, got ", x.describe(), " and ", y.describe());
}

Window window_of(const Pool2dGeometry& g) {
  return {g.kh, g.kw, g.stride_h, g.stride_w, g.pad_h, g.pad_w};
}

void check_indices(const char* op, const Tensor& indices, const Tensor& y) {
  check_4d(op, indices, "indices");
  CHORUS_CHECK(indices.dtype() == kInt64 && indices.sizes() == y.sizes(), op,
               ": expected int64 indices of shape ", shape_str(y.sizes()), ", got ",
               indices.describe());
}

}  // namespace

void max_pool2d_forward(const Pool2dGeometry& g, const Tensor& x, const Tensor& y,
                        const Tensor& indices) {
  const char* op = "max_pool2d_forward";
  check_pool(op, g, x, "x", y, "y");
  check_indices(op, indices, y);
  if (y.numel() == 0) return;
  CudaDeviceGuard guard(y.device().index);
  const Launch l = launch_for(y);
  dispatch_float(x.dtype(), op, [&]<typename T>() {
    max_pool_forward_kernel<T><<<l.blocks, kBlockThreads, 0, l.stream>>>(
        static_cast<const T*>(x.raw_data()), strides_of(x), sizes_of(x),
        static_cast<T*>(y.raw_data()), strides_of(y), sizes_of(y), indices.data<int64_t>(),
        strides_of(indices), window_of(g), walk_channels_last(y), l.total);
    CHORUS_CUDA_LAUNCH_CHECK();
  });
}

void max_pool2d_backward(const Pool2dGeometry& g, const Tensor& dy, const Tensor& indices,
                         const Tensor& dx) {
  const char* op = "max_pool2d_backward";
  check_pool(op, g, dx, "dx", dy, "dy");
  check_indices(op, indices, dy);
  if (dx.numel() == 0) return;
  CudaDeviceGuard guard(dx.device().index);
  const Launch l = launch_for(dx);
  dispatch_float(dx.dtype(), op, [&]<typename T>() {
    max_pool_backward_kernel<T><<<l.blocks, kBlockThreads, 0, l.stream>>>(
        static_cast<const T*>(dy.raw_data()), strides_of(dy), sizes_of(dy), indices.data<int64_t>(),
        strides_of(indices), static_cast<T*>(dx.raw_data()), strides_of(dx), sizes_of(dx),
        window_of(g), walk_channels_last(dx), l.total);
    CHORUS_CUDA_LAUNCH_CHECK();
  });
}

void avg_pool2d_forward(const Pool2dGeometry& g, const Tensor& x, const Tensor& y) {
  const char* op = "avg_pool2d_forward";
  check_pool(op, g, x, "x", y, "y");
  if (y.numel() == 0) return;
  CudaDeviceGuard guard(y.device().index);
  const Launch l = launch_for(y);
  dispatch_float(x.dtype(), op, [&]<typename T>() {
    avg_pool_forward_kernel<T><<<l.blocks, kBlockThreads, 0, l.stream>>>(
        static_cast<const T*>(x.raw_data()), strides_of(x), sizes_of(x),
        static_cast<T*>(y.raw_data()), strides_of(y), sizes_of(y), window_of(g),
        walk_channels_last(y), l.total);
    CHORUS_CUDA_LAUNCH_CHECK();
  });
}

void avg_pool2d_backward(const Pool2dGeometry& g, const Tensor& dy, const Tensor& dx) {
  const char* op = "avg_pool2d_backward";
  check_pool(op, g, dx, "dx", dy, "dy");
  if (dx.numel() == 0) return;
  CudaDeviceGuard guard(dx.device().index);
  const Launch l = launch_for(dx);
  dispatch_float(dx.dtype(), op, [&]<typename T>() {
    avg_pool_backward_kernel<T><<<l.blocks, kBlockThreads, 0, l.stream>>>(
        static_cast<const T*>(dy.raw_data()), strides_of(dy), sizes_of(dy),
        static_cast<T*>(dx.raw_data()), strides_of(dx), sizes_of(dx), window_of(g),
        walk_channels_last(dx), l.total);
    CHORUS_CUDA_LAUNCH_CHECK();
  });
}

void adaptive_avg_pool2d_forward(const Tensor& x, const Tensor& y) {
  const char* op = "adaptive_avg_pool2d_forward";
  check_4d(op, x, "x");
  check_4d(op, y, "y");
  CHORUS_CHECK(x.size(0) == y.size(0) && x.size(1) == y.size(1) && x.dtype() == y.dtype(), op,
               ": x and y must share N, C and dtype, got ", x.describe(), " and ", y.describe());
  if (y.numel() == 0) return;
  CHORUS_CHECK(x.size(2) > 0 && x.size(3) > 0, op, ": empty input plane ", x.describe());
  CudaDeviceGuard guard(y.device().index);
  const Launch l = launch_for(y);
  dispatch_float(x.dtype(), op, [&]<typename T>() {
    adaptive_avg_forward_kernel<T><<<l.blocks, kBlockThreads, 0, l.stream>>>(
        static_cast<const T*>(x.raw_data()), strides_of(x), sizes_of(x),
        static_cast<T*>(y.raw_data()), strides_of(y), sizes_of(y), walk_channels_last(y), l.total);
    CHORUS_CUDA_LAUNCH_CHECK();
  });
}

void adaptive_avg_pool2d_backward(const Tensor& dy, const Tensor& dx) {
  const char* op = "adaptive_avg_pool2d_backward";
  check_4d(op, dy, "dy");
  check_4d(op, dx, "dx");
  CHORUS_CHECK(dx.size(0) == dy.size(0) && dx.size(1) == dy.size(1) && dx.dtype() == dy.dtype(), op,
               ": dy and dx must share N, C and dtype, got ", dy.describe(), " and ",
               dx.describe());
  if (dx.numel() == 0) return;
  CHORUS_CHECK(dy.size(2) > 0 && dy.size(3) > 0, op, ": empty output plane ", dy.describe());
  CudaDeviceGuard guard(dx.device().index);
  const Launch l = launch_for(dx);
  const bool nhwc = walk_channels_last(dx);
  const bool dense = nhwc ? dx.stride(0) == dx.size(1) * dx.size(2) * dx.size(3) &&
                                dx.stride(2) == dx.size(1) * dx.size(3) && dx.stride(3) == dx.size(1)
                          : dx.is_contiguous();
  if (dy.size(2) == 1 && dy.size(3) == 1 && dense) {
    const int64_t c = dx.size(1), hw = dx.size(2) * dx.size(3);
    const float hw_f = static_cast<float>(hw);  // divided, as the general kernel does
    dispatch_float(dx.dtype(), op, [&]<typename T>() {
      const T* dyp = static_cast<const T*>(dy.raw_data());
      T* dxp = static_cast<T*>(dx.raw_data());
      constexpr int kVec = 16 / sizeof(T);
      if (nhwc && c % kVec == 0 && reinterpret_cast<uintptr_t>(dxp) % 16 == 0) {
        const int64_t packs = l.total / kVec;
        const unsigned blocks =
            static_cast<unsigned>(std::clamp<int64_t>((packs + kBlockThreads - 1) / kBlockThreads, 1, int64_t{1} << 20));
        global_avg_backward_nhwc_kernel<T, kVec><<<blocks, kBlockThreads, 0, l.stream>>>(
            dyp, dy.stride(0), dy.stride(1), dxp, c, hw, packs, hw_f);
      } else if (l.total < (int64_t{1} << 31)) {
        global_avg_backward_kernel<T, int32_t><<<l.blocks, kBlockThreads, 0, l.stream>>>(
            dyp, dy.stride(0), dy.stride(1), dxp, static_cast<int32_t>(c), static_cast<int32_t>(hw), nhwc,
            static_cast<int32_t>(l.total), hw_f);
      } else {
        global_avg_backward_kernel<T, int64_t><<<l.blocks, kBlockThreads, 0, l.stream>>>(
            dyp, dy.stride(0), dy.stride(1), dxp, c, hw, nhwc, l.total, hw_f);
      }
      CHORUS_CUDA_LAUNCH_CHECK();
    });
    return;
  }
  dispatch_float(dx.dtype(), op, [&]<typename T>() {
    adaptive_avg_backward_kernel<T><<<l.blocks, kBlockThreads, 0, l.stream>>>(
        static_cast<const T*>(dy.raw_data()), strides_of(dy), sizes_of(dy),
        static_cast<T*>(dx.raw_data()), strides_of(dx), sizes_of(dx), walk_channels_last(dx),
        l.total);
    CHORUS_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace chorus::cuda
