// Note [Convolutions of few input channels as GEMMs] (conv_gemm.h): the
// im2col and col2im gathers, and the GEMMs through the kernel set's gemm.
#include "chorus/cuda/conv/conv_gemm.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "chorus/core/error.h"
#include "chorus/cuda/runtime/context.h"
#include "chorus/cuda/kernels/dtype_dispatch.cuh"
#include "chorus/cuda/kernels/kernels.h"
#include "chorus/cuda/runtime/path_switch.h"

namespace chorus::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;           // channels per 16-byte pack of bf16 / fp16
constexpr int64_t kMaxInputChannels = 32;

template <typename T>
struct alignas(16) Pack8 {
  T v[kVec];
};

// The geometry as the kernels index it (NHWC, one group).
struct Geom {
  int64_t n, c, h, w, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw;
  __host__ __device__ int64_t cols() const { return kh * kw * c; }
};

Geom geom_of(const Conv2dGeometry& g) {
  return {g.n,     g.c_in,     g.h,        g.w,     g.out_h(), g.out_w(), g.kh,
          g.kw,    g.stride_h, g.stride_w, g.pad_h, g.pad_w,   g.dil_h,   g.dil_w};
}

// cols[m, (r * kw + s) * C + c] = x[n, oh * sh - ph + r * dh, ow * sw - pw + s * dw, c]
// (0 outside the image), m = (n * OH + oh) * OW + ow; one 8-channel pack a thread.
template <typename T>
__global__ void __launch_bounds__(kThreads) im2col_nhwc_kernel(const T* __restrict__ x, T* __restrict__ cols, Geom g,
                                                                int64_t packs) {
  const int64_t cp_per = g.c / kVec;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < packs; i += int64_t{gridDim.x} * blockDim.x) {
    int64_t t = i;
    const int64_t cp = t % cp_per;
    t /= cp_per;
    const int64_t s = t % g.kw;
    t /= g.kw;
    const int64_t r = t % g.kh;
    const int64_t m = t / g.kh;
    const int64_t ow = m % g.ow, oh = (m / g.ow) % g.oh, n = m / (g.ow * g.oh);
    const int64_t hi = oh * g.sh - g.ph + r * g.dh, wi = ow * g.sw - g.pw + s * g.dw;
    Pack8<T> v;
    if (hi >= 0 && hi < g.h && wi >= 0 && wi < g.w) {
      v = *reinterpret_cast<const Pack8<T>*>(x + ((n * g.h + hi) * g.w + wi) * g.c + cp * kVec);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) v.v[j] = convert<T>(0.0f);
    }
    // i is the pack's own index in cols: [m][r][s][cp].
    reinterpret_cast<Pack8<T>*>(cols)[i] = v;
  }
}

// dx[n, h, w, c] = sum over the (r, s) whose window covers (h, w) of
// dcols[m(oh, ow), (r * kw + s) * C + c], summed in float; one pack a thread.
template <typename T>
__global__ void __launch_bounds__(kThreads) col2im_nhwc_kernel(const T* __restrict__ dcols, T* __restrict__ dx,
                                                                Geom g, int64_t packs) {
  const int64_t cp_per = g.c / kVec, ncols = g.cols();
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < packs; i += int64_t{gridDim.x} * blockDim.x) {
    int64_t t = i;
    const int64_t cp = t % cp_per;
    t /= cp_per;
    const int64_t w = t % g.w;
    t /= g.w;
    const int64_t h = t % g.h;
    const int64_t n = t / g.h;
    float acc[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) acc[j] = 0.0f;
    for (int64_t r = 0; r < g.kh; ++r) {
      const int64_t th = h + g.ph - r * g.dh;
      if (th < 0 || th % g.sh != 0 || th / g.sh >= g.oh) continue;
      const int64_t oh = th / g.sh;
      for (int64_t s = 0; s < g.kw; ++s) {
        const int64_t tw = w + g.pw - s * g.dw;
        if (tw < 0 || tw % g.sw != 0 || tw / g.sw >= g.ow) continue;
        const int64_t m = (n * g.oh + oh) * g.ow + tw / g.sw;
        const Pack8<T> v = *reinterpret_cast<const Pack8<T>*>(dcols + m * ncols + (r * g.kw + s) * g.c + cp * kVec);
#pragma unroll
        for (int j = 0; j < kVec; ++j) acc[j] += static_cast<float>(to_acc(v.v[j]));
      }
    }
    Pack8<T> out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) out.v[j] = convert<T>(acc[j]);
    reinterpret_cast<Pack8<T>*>(dx)[i] = out;
  }
}

unsigned blocks_for(int64_t packs) {
  return static_cast<unsigned>(std::clamp<int64_t>((packs + kThreads - 1) / kThreads, 1, int64_t{1} << 20));
}

// The im2col matrix of x as a [1, M, RSC] tensor.
Tensor im2col(const Geom& g, const Tensor& x) {
  const int64_t m = g.n * g.oh * g.ow;
  Tensor cols = detail::empty_tensor({1, m, g.cols()}, x.dtype(), x.device());
  const int64_t packs = m * g.cols() / kVec;
  dispatch_float(x.dtype(), "conv_gemm", [&]<typename T>() {
    if constexpr (sizeof(T) == 2) {
      im2col_nhwc_kernel<T><<<blocks_for(packs), kThreads, 0, current_stream(x.device().index)>>>(
          static_cast<const T*>(x.raw_data()), static_cast<T*>(cols.raw_data()), g, packs);
      CHORUS_CUDA_LAUNCH_CHECK();
    }
  });
  return cols;
}

// A dense channels-last [A, B, C, D] tensor (or the filter) as the row-major
// [1, rows, cols] matrix of its bytes.
Tensor as_matrix(const Tensor& t, int64_t rows, int64_t cols) {
  return detail::make_view(t, {1, rows, cols}, {rows * cols, cols, 1}, t.storage_offset());
}

PathSwitch& path_switch() {
  static PathSwitch* sw = new PathSwitch("CHORUS_CONV_GEMM");  // leaked: read from any thread until exit
  return *sw;
}

}  // namespace

bool conv_gemm_enabled() { return path_switch().on(); }
void set_conv_gemm_enabled(bool on) { path_switch().set(on); }

bool conv_gemm_applies(const Conv2dGeometry& g, Layout layout, DType dtype) {
  return layout == Layout::NHWC && (dtype == kBFloat16 || dtype == kFloat16) && g.groups == 1 &&
         g.c_in % kVec == 0 && g.c_in <= kMaxInputChannels && g.n > 0 && g.out_h() > 0 && g.out_w() > 0;
}

void conv_gemm_forward(const Conv2dGeometry& g, const Tensor& x, const Tensor& w, const Tensor& y) {
  const Geom q = geom_of(g);
  const int64_t m = q.n * q.oh * q.ow;
  const Tensor cols = im2col(q, x);
  gemm(cols, as_matrix(w, g.c_out, q.cols()), as_matrix(y, m, g.c_out), false, true, 1.0, 0.0);
}

void conv_gemm_backward_input(const Conv2dGeometry& g, const Tensor& dy, const Tensor& w, const Tensor& dx) {
  const Geom q = geom_of(g);
  const int64_t m = q.n * q.oh * q.ow;
  Tensor dcols = detail::empty_tensor({1, m, q.cols()}, dx.dtype(), dx.device());
  gemm(as_matrix(dy, m, g.c_out), as_matrix(w, g.c_out, q.cols()), dcols, false, false, 1.0, 0.0);
  const int64_t packs = q.n * q.h * q.w * q.c / kVec;
  dispatch_float(dx.dtype(), "conv_gemm", [&]<typename T>() {
    if constexpr (sizeof(T) == 2) {
      col2im_nhwc_kernel<T><<<blocks_for(packs), kThreads, 0, current_stream(dx.device().index)>>>(
          static_cast<const T*>(dcols.raw_data()), static_cast<T*>(dx.raw_data()), q, packs);
      CHORUS_CUDA_LAUNCH_CHECK();
    }
  });
}

void conv_gemm_backward_weight(const Conv2dGeometry& g, const Tensor& dy, const Tensor& x, const Tensor& dw) {
  const Geom q = geom_of(g);
  const int64_t m = q.n * q.oh * q.ow;
  const Tensor cols = im2col(q, x);
  gemm(as_matrix(dy, m, g.c_out), cols, as_matrix(dw, g.c_out, q.cols()), true, false, 1.0, 0.0);
}

}  // namespace chorus::cuda
