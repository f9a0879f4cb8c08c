// Note [Direct convolutions of a few input channels] (conv_direct.h): the
// forward and weight-gradient kernels.
#include "chorus/cuda/conv/conv_direct.h"

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
constexpr int64_t kMaxInputChannels = 4;
constexpr int kMaxTaps = 64;       // kh * kw * C_in
constexpr int kMaxOutChannels = 64;
// Shared memory a weight-gradient block stages its pixel tile in (floats):
// under the 48 KB a block gets without opting in.
constexpr int kStageFloats = 10 * 1024;
// Output pixels a block stages at a time (at most).
constexpr int kMaxTile = 256;

// The geometry as the kernels index it (NHWC, one group).
struct Geom {
  int64_t n, c, h, w, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw, k;
  __host__ __device__ int taps() const { return static_cast<int>(kh * kw * c); }
  // The taps padded to a multiple of 4 (zeros after the last).
  __host__ __device__ int taps4() const { return (taps() + 3) / 4 * 4; }
  // A staged pixel's row in shared memory (floats): taps4, or 4 more when
  // taps4 / 4 is even, so that a warp's 16-byte reads of consecutive rows
  // fall in different banks.
  __host__ __device__ int row() const { return (taps4() / 4) % 2 == 0 ? taps4() + 4 : taps4(); }
  __host__ __device__ int64_t pixels() const { return n * oh * ow; }
};

Geom geom_of(const Conv2dGeometry& g) {
  return {g.n,  g.c_in,     g.h,        g.w,     g.out_h(), g.out_w(), g.kh,   g.kw,
          g.stride_h, g.stride_w, g.pad_h, g.pad_w, g.dil_h, g.dil_w, g.c_out};
}

// The taps t = (r * kw + s) * C + c of a block's convolution as offsets: row
// and column from the window's corner, and channel. Filled once per block.
struct TapTable {
  int dh[kMaxTaps], dw[kMaxTaps], c[kMaxTaps];
};

__device__ __forceinline__ void fill_taps(TapTable& tt, const Geom& g) {
  const int taps = g.taps(), c_in = static_cast<int>(g.c), kw = static_cast<int>(g.kw);
  for (int t = threadIdx.x; t < taps; t += blockDim.x) {
    const int rs = t / c_in;
    tt.dh[t] = (rs / kw) * static_cast<int>(g.dh);
    tt.dw[t] = (rs % kw) * static_cast<int>(g.dw);
    tt.c[t] = t % c_in;
  }
}

// Taps first .. first + kCount - 1 of output pixel m into v: v[i] = the
// input under tap first + i (0 outside the image, past the last tap, and for
// m past the last pixel).
// Every load is independent of the others and issued before any is used, so
// a thread waits for memory once per pixel, not once per tap; a warp's
// threads are on consecutive pixels, so each tap's loads are coalesced.
template <int kCount, typename T>
__device__ __forceinline__ void load_taps(const T* __restrict__ x, const Geom& g, const TapTable& tt, int64_t m,
                                          int first, float (&v)[kCount]) {
  const int taps = g.taps(), h = static_cast<int>(g.h), w = static_cast<int>(g.w), c = static_cast<int>(g.c);
  const bool live = m < g.pixels();
  const int64_t ow = live ? m % g.ow : 0, rest = live ? m / g.ow : 0;
  const int h0 = static_cast<int>((rest % g.oh) * g.sh - g.ph), w0 = static_cast<int>(ow * g.sw - g.pw);
  const T* xn = x + (rest / g.oh) * g.h * g.w * g.c;
#pragma unroll
  for (int i = 0; i < kCount; ++i) {
    const int t = first + i;
    float val = 0.0f;
    if (t < taps && live) {
      const int hi = h0 + tt.dh[t], wi = w0 + tt.dw[t];
      if (hi >= 0 && hi < h && wi >= 0 && wi < w) val = static_cast<float>(to_acc(xn[(hi * w + wi) * c + tt.c[t]]));
    }
    v[i] = val;
  }
}

// y[m, :] for output pixels m, one a thread (consecutive threads on
// consecutive pixels): its taps in registers (load_taps), then KC output
// channels at a time against the filter in shared memory, laid out
// [chunk][tap][KC] so a tap's KC weights are KC / 4 vector loads every thread
// of the block shares. kTaps bounds the taps (the registers they take): 28
// for a 3x3 filter over 3 channels, else kMaxTaps.
template <typename T, int KC, int kTaps>
__global__ void __launch_bounds__(kThreads) direct_forward_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                                                   T* __restrict__ y, Geom g, bool aligned) {
  extern __shared__ float4 smem4[];
  __shared__ TapTable tt;
  const int taps = g.taps(), k = static_cast<int>(g.k), chunks = k / KC;
  float* sw = reinterpret_cast<float*>(smem4);  // [chunk][taps][KC]
  // w is [K][taps].
  for (int i = threadIdx.x; i < chunks * taps * KC; i += blockDim.x) {
    const int j = i % KC, t = (i / KC) % taps, chunk = i / (KC * taps);
    sw[i] = static_cast<float>(to_acc(w[(chunk * KC + j) * taps + t]));
  }
  fill_taps(tt, g);
  __syncthreads();
  const int64_t pixels = g.pixels();
  for (int64_t m0 = int64_t{blockIdx.x} * blockDim.x; m0 < pixels; m0 += int64_t{gridDim.x} * blockDim.x) {
    const int64_t m = m0 + threadIdx.x;
    float v[kTaps];
    load_taps(x, g, tt, m, 0, v);
    if (m >= pixels) continue;
    for (int chunk = 0; chunk < chunks; ++chunk) {
      float acc[KC];
#pragma unroll
      for (int j = 0; j < KC; ++j) acc[j] = 0.0f;
      const float4* wc = reinterpret_cast<const float4*>(sw + chunk * taps * KC);
#pragma unroll
      for (int t = 0; t < kTaps; ++t) {
        if (t < taps) {
#pragma unroll
          for (int q = 0; q < KC / 4; ++q) {
            const float4 wv = wc[t * (KC / 4) + q];
            acc[4 * q + 0] = fmaf(v[t], wv.x, acc[4 * q + 0]);
            acc[4 * q + 1] = fmaf(v[t], wv.y, acc[4 * q + 1]);
            acc[4 * q + 2] = fmaf(v[t], wv.z, acc[4 * q + 2]);
            acc[4 * q + 3] = fmaf(v[t], wv.w, acc[4 * q + 3]);
          }
        }
      }
      T* out = y + m * g.k + chunk * KC;
      if (aligned) {
        struct alignas(16) Pack8 {
          T v[8];
        };
#pragma unroll
        for (int hh = 0; hh < KC / 8; ++hh) {
          Pack8 pk;
#pragma unroll
          for (int j = 0; j < 8; ++j) pk.v[j] = convert<T>(acc[8 * hh + j]);
          reinterpret_cast<Pack8*>(out)[hh] = pk;
        }
      } else {
#pragma unroll
        for (int j = 0; j < KC; ++j) out[j] = convert<T>(acc[j]);
      }
    }
  }
}

// The weight gradient's partial sums: block b sums, over its tiles of P output
// pixels, dW[o] for every output o = k * taps + t (k an output channel, t a
// tap), and writes them to partial[b, o]. A tile's dy rows [P][K] (16-byte
// loads when dy is aligned) and tap values [P][row] (load_taps, a thread a
// pixel; taps padded to a multiple of 4 with zeros) are staged in shared
// memory as floats; thread (u, grp) owns the 4x4 outputs of micro-tile u
// (output channels 4 * (u / MT) .. +3, taps 4 * (u % MT) .. +3, MT = taps4 /
// 4) over the tile's pixels p = grp, grp + groups, ...; at the end the groups'
// sums are added in shared memory in group order. Every sum is in a fixed
// order: the result does not depend on timing.
template <typename T>
__global__ void __launch_bounds__(kThreads) direct_wgrad_partial_kernel(const T* __restrict__ dy,
                                                                         const T* __restrict__ x,
                                                                         float* __restrict__ partial, Geom g, int p_tile,
                                                                         int64_t tiles, bool dy_vectors) {
  extern __shared__ float4 smem4[];
  __shared__ TapTable tt;
  float* sm = reinterpret_cast<float*>(smem4);
  const int taps = g.taps(), taps4 = g.taps4(), row = g.row(), k = static_cast<int>(g.k);
  fill_taps(tt, g);
  const int mt = taps4 / 4, units = (k / 4) * mt, groups = kThreads / units;
  float* dys = sm;                  // [P][K]
  float* xs = sm + p_tile * k;      // [P][row]
  const int u = threadIdx.x % units, grp = threadIdx.x / units;
  const int k0 = 4 * (u / mt), t0 = 4 * (u % mt);
  float acc[4][4];
#pragma unroll
  for (int a = 0; a < 4; ++a)
#pragma unroll
    for (int b = 0; b < 4; ++b) acc[a][b] = 0.0f;
  const int64_t pixels = g.pixels();
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t m0 = tile * p_tile;
    __syncthreads();  // the previous tile's reads are done (and the tap table filled)
    const int64_t live = std::min<int64_t>(p_tile, pixels - m0) * k;  // dy elements of this tile
    if (dy_vectors) {  // 8 elements a load; k is a multiple of 8
      struct alignas(16) Pack8 {
        T v[8];
      };
      const Pack8* src = reinterpret_cast<const Pack8*>(dy + m0 * k);
#pragma unroll 4
      for (int i = threadIdx.x; i < p_tile * k / 8; i += blockDim.x) {
        Pack8 pk{};
        if (8 * int64_t{i} < live) pk = src[i];
        float4 lo, hi;
        lo.x = static_cast<float>(to_acc(pk.v[0]));
        lo.y = static_cast<float>(to_acc(pk.v[1]));
        lo.z = static_cast<float>(to_acc(pk.v[2]));
        lo.w = static_cast<float>(to_acc(pk.v[3]));
        hi.x = static_cast<float>(to_acc(pk.v[4]));
        hi.y = static_cast<float>(to_acc(pk.v[5]));
        hi.z = static_cast<float>(to_acc(pk.v[6]));
        hi.w = static_cast<float>(to_acc(pk.v[7]));
        reinterpret_cast<float4*>(dys)[2 * i] = lo;
        reinterpret_cast<float4*>(dys)[2 * i + 1] = hi;
      }
    } else {
#pragma unroll 4
      for (int i = threadIdx.x; i < p_tile * k; i += blockDim.x)
        dys[i] = i < live ? static_cast<float>(to_acc(dy[m0 * k + i])) : 0.0f;
    }
    for (int p = threadIdx.x; p < p_tile; p += blockDim.x) {
      // Half the taps at a time (not unrolled): all 64 in flight cost more
      // registers than a block of 256 threads has.
      float4* dst = reinterpret_cast<float4*>(xs + p * row);
#pragma unroll 1
      for (int first = 0; first < taps; first += kMaxTaps / 2) {
        float v[kMaxTaps / 2];
        load_taps(x, g, tt, m0 + p, first, v);
#pragma unroll
        for (int i = 0; i < kMaxTaps / 8; ++i)
          if (first / 4 + i < mt) dst[first / 4 + i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
      }
    }
    __syncthreads();
    if (grp < groups) {
      for (int p = grp; p < p_tile; p += groups) {
        const float4 d = *reinterpret_cast<const float4*>(dys + p * k + k0);
        const float4 v = *reinterpret_cast<const float4*>(xs + p * row + t0);
        const float dv[4] = {d.x, d.y, d.z, d.w}, xv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
          for (int b = 0; b < 4; ++b) acc[a][b] = fmaf(dv[a], xv[b], acc[a][b]);
      }
    }
  }
  // The groups' sums, in group order: red[grp][u][16] reuses the stage.
  __syncthreads();
  float* red = sm;
  if (grp < groups) {
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < 4; ++b) red[(grp * units + u) * 16 + a * 4 + b] = acc[a][b];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < units * 16; i += blockDim.x) {
    const int uu = i / 16, ab = i % 16, a = ab / 4, b = ab % 4;
    float s = 0.0f;
    for (int q = 0; q < groups; ++q) s += red[(q * units + uu) * 16 + ab];
    const int kk = 4 * (uu / mt) + a, t = 4 * (uu % mt) + b;
    if (t < taps) partial[int64_t{blockIdx.x} * k * taps + kk * taps + t] = s;
  }
}

// dweight[k, c, r, s] (at the given strides) = sum over the blocks of
// partial[b, k * taps + (r * kw + s) * C + c], in block order; 32 lanes per
// output, each adding every 32nd block, then a tree (as the batch norm's
// finalize).
template <typename O>
__global__ void direct_wgrad_finalize_kernel(const float* __restrict__ partial, int64_t blocks, Geom g,
                                             O* __restrict__ dw, int64_t sk, int64_t sc, int64_t sr, int64_t ss) {
  constexpr int kCols = 32, kLanes = 32;
  const int taps = g.taps();
  const int64_t outs = g.k * taps;
  const int64_t o = int64_t{blockIdx.x} * kCols + threadIdx.x;
  float s = 0.0f;
  if (o < outs)
    for (int64_t b = threadIdx.y; b < blocks; b += kLanes) s += partial[b * outs + o];
  __shared__ float sh[kLanes][kCols];
  sh[threadIdx.y][threadIdx.x] = s;
  for (int half = kLanes / 2; half > 0; half /= 2) {
    __syncthreads();
    if (threadIdx.y < half) {
      s += sh[threadIdx.y + half][threadIdx.x];
      sh[threadIdx.y][threadIdx.x] = s;
    }
  }
  if (threadIdx.y != 0 || o >= outs) return;
  const int64_t kk = o / taps, t = o % taps;
  const int64_t c = t % g.c, rs = t / g.c, ssi = rs % g.kw, r = rs / g.kw;
  dw[kk * sk + c * sc + r * sr + ssi * ss] = convert<O>(s);
}

// The pixels a weight-gradient block stages at a time: what the stage holds
// beside `fixed` floats, a multiple of 32, at most kMaxTile (a thread a pixel).
int tile_pixels(int fixed, int per_pixel) {
  return std::clamp((kStageFloats - fixed) / per_pixel / 32 * 32, 32, kMaxTile);
}

int64_t tile_blocks(int64_t tiles, int device, int per_sm) {
  return std::clamp<int64_t>(tiles, 1, int64_t{per_sm} * device_properties(device).multiProcessorCount);
}

PathSwitch& path_switch() {
  static PathSwitch* sw = new PathSwitch("CHORUS_CONV_DIRECT");  // leaked: read from any thread until exit
  return *sw;
}

}  // namespace

static std::atomic<int64_t> direct_runs{0};  // conv_direct_runs()

bool conv_direct_enabled() { return path_switch().on(); }
int64_t conv_direct_runs() { return direct_runs.load(std::memory_order_relaxed); }
void set_conv_direct_enabled(bool on) { path_switch().set(on); }

bool conv_direct_applies(const Conv2dGeometry& g, Layout layout, DType dtype) {
  return layout == Layout::NHWC && (dtype == kBFloat16 || dtype == kFloat16) && g.groups == 1 && g.c_in >= 1 &&
         g.c_in <= kMaxInputChannels && g.kh * g.kw * g.c_in <= kMaxTaps && g.c_out % 8 == 0 &&
         g.c_out <= kMaxOutChannels && g.n > 0 && g.out_h() > 0 && g.out_w() > 0;
}

void conv_direct_forward(const Conv2dGeometry& g, const Tensor& x, const Tensor& w, const Tensor& y) {
  CHORUS_CHECK(conv_direct_applies(g, Layout::NHWC, x.dtype()) && w.dtype() == x.dtype() && y.dtype() == x.dtype(),
               "conv_direct_forward: not a convolution the direct kernels compute: ", x.describe(), ", ",
               w.describe(), ", ", y.describe());
  direct_runs.fetch_add(1, std::memory_order_relaxed);
  const Geom q = geom_of(g);
  const int device = x.device().index;
  const bool aligned = reinterpret_cast<uintptr_t>(y.raw_data()) % 16 == 0;
  const size_t smem = sizeof(float) * static_cast<size_t>(q.k * q.taps());
  const int64_t tiles = (q.pixels() + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(tile_blocks(tiles, device, 8));
  dispatch_float(x.dtype(), "conv_direct", [&]<typename T>() {
    if constexpr (sizeof(T) == 2) {
      const T* xp = static_cast<const T*>(x.raw_data());
      const T* wp = static_cast<const T*>(w.raw_data());
      T* yp = static_cast<T*>(y.raw_data());
      cudaStream_t stream = current_stream(device);
      auto launch = [&]<int KC>() {
        if (q.taps() <= 28)
          direct_forward_kernel<T, KC, 28><<<blocks, kThreads, smem, stream>>>(xp, wp, yp, q, aligned);
        else
          direct_forward_kernel<T, KC, kMaxTaps><<<blocks, kThreads, smem, stream>>>(xp, wp, yp, q, aligned);
      };
      if (q.k % 16 == 0)
        launch.template operator()<16>();
      else
        launch.template operator()<8>();
      CHORUS_CUDA_LAUNCH_CHECK();
    }
  });
}

void conv_direct_backward_weight(const Conv2dGeometry& g, const Tensor& dy, const Tensor& x, const Tensor& dweight) {
  CHORUS_CHECK(conv_direct_applies(g, Layout::NHWC, x.dtype()) && dy.dtype() == x.dtype(),
               "conv_direct_backward_weight: not a convolution the direct kernels compute: ", x.describe(), ", ",
               dy.describe());
  CHORUS_CHECK(dweight.dim() == 4 && (dweight.dtype() == kFloat32 || dweight.dtype() == x.dtype()),
               "conv_direct_backward_weight: dweight must be a 4-d float32 or ", dtype_name(x.dtype()),
               " tensor, got ", dweight.describe());
  direct_runs.fetch_add(1, std::memory_order_relaxed);
  const Geom q = geom_of(g);
  const int device = x.device().index;
  const int taps = q.taps(), taps4 = q.taps4(), row = q.row();
  const int p_tile = tile_pixels(0, static_cast<int>(q.k) + row);
  const int units = static_cast<int>(q.k / 4) * (taps4 / 4);
  CHORUS_CHECK(units <= kThreads, "conv_direct_backward_weight: ", units, " micro-tiles exceed a block");
  const size_t smem =
      sizeof(float) * std::max<size_t>(static_cast<size_t>(p_tile) * (q.k + row),
                                       static_cast<size_t>(kThreads / units) * units * 16);
  const int64_t tiles = (q.pixels() + p_tile - 1) / p_tile;
  const int64_t blocks = tile_blocks(tiles, device, 2);
  const int64_t outs = q.k * taps;
  Tensor partial = detail::empty_tensor({blocks * outs}, kFloat32, x.device());
  cudaStream_t stream = current_stream(device);
  dispatch_float(x.dtype(), "conv_direct", [&]<typename T>() {
    if constexpr (sizeof(T) == 2) {
      direct_wgrad_partial_kernel<T><<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(
          static_cast<const T*>(dy.raw_data()), static_cast<const T*>(x.raw_data()),
          static_cast<float*>(partial.raw_data()), q, p_tile, tiles,
          reinterpret_cast<uintptr_t>(dy.raw_data()) % 16 == 0);
      CHORUS_CUDA_LAUNCH_CHECK();
      const dim3 fin_grid(static_cast<unsigned>((outs + 31) / 32)), fin_block(32, 32);
      // dweight is [K, C, R, S] (its own strides, whatever its layout).
      const int64_t sk = dweight.stride(0), sc = dweight.stride(1), sr = dweight.stride(2), ss = dweight.stride(3);
      if (dweight.dtype() == kFloat32) {
        direct_wgrad_finalize_kernel<float><<<fin_grid, fin_block, 0, stream>>>(
            static_cast<const float*>(partial.raw_data()), blocks, q, static_cast<float*>(dweight.raw_data()), sk, sc,
            sr, ss);
      } else {
        direct_wgrad_finalize_kernel<T><<<fin_grid, fin_block, 0, stream>>>(
            static_cast<const float*>(partial.raw_data()), blocks, q, static_cast<T*>(dweight.raw_data()), sk, sc,
            sr, ss);
      }
      CHORUS_CUDA_LAUNCH_CHECK();
    }
  });
}

}  // namespace chorus::cuda
