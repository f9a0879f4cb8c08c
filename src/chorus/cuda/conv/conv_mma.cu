// Note [Tensor-core convolutions of few channels] (conv_mma.h): the
// implicit-GEMM kernel.
#include "chorus/cuda/conv/conv_mma.h"

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

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kStages = 3;  // the halo's pipeline depth
constexpr size_t kMaxFilterBytes = 100 * 1024;
constexpr size_t kMaxStageBytes = 24 * 1024;
constexpr size_t kMaxSmemBytes = kMaxFilterBytes + kStages * kMaxStageBytes;
constexpr int kMaxDevices = 64;

// The convolution as the kernel computes it: out[p, o] = sum over taps (r, s)
// and input channels c of in[n, oh - ph + r, ow - pw + s, c] * f[o, r, s, c]
// (stride and dilation 1; NHWC; f dense [cout][r][s][cin]).
struct MGeom {
  int64_t n, h, w, oh, ow;  // the input's height and width, the output's
  int cin, cout, r, s, ph, pw;
  int srow;    // elements between the filter's rows in shared memory
  int tr;      // output rows a tile
  int hr, hc;  // a tile's halo: tr + r - 1 input rows, ow + s - 1 columns
};

// A filter row in shared memory: r*s*cin elements, padded so that its 4-byte
// words number 8 mod 32. A warp's B loads then touch 4 consecutive rows per
// half-warp at word offsets 0, 8, 16, 24 (mod 32) plus 0..7: every bank once.
int filter_row(int kdim) {
  const int words = kdim / 2;  // kdim is a multiple of 16
  return 2 * (words + (8 - words % 32 + 32) % 32);
}

// The output channel that logical column l of the GEMM holds: inside each 16,
// the D fragment gives a thread columns 2t, 2t+1 of one n8 tile and the same
// of the next; those four are channels 4t .. 4t+3, so its stores are 8 bytes.
__host__ __device__ __forceinline__ int phys_channel(int l) {
  const int ll = l & 15, q = ll & 7;
  return (l & ~15) + 4 * (q >> 1) + 2 * (ll >> 3) + (q & 1);
}

template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// Block: a tile of BM = 32 * WM output pixels -- tr whole output rows of one
// image -- and all cout channels; warp (wm, wn): 32 pixels (two m16 tiles,
// each inside one row) by NT n8 tiles. The filter is copied once into shared
// memory (row l = output channel phys_channel(l)); blocks then walk their
// tiles. A tile's reduction runs in steps of 16 input channels: each step's
// input, the tile's halo (tr + r - 1 rows by ow + s - 1 columns, 32 bytes a
// pixel, zeros outside the image), is staged by cp.async kStages - 1 steps
// ahead, through the block's tiles without a break, so the loads' latency
// hides behind the products of the steps before; every tap then reads its A
// operands from the halo, each input pixel coming from memory about once.
template <typename T, int WM, int WN, int NT>
__global__ void __launch_bounds__(kThreads) mma_conv_kernel(const T* __restrict__ x, const T* __restrict__ f,
                                                             T* __restrict__ y, MGeom g) {
  static_assert(WM * WN == kWarps && NT % 2 == 0, "a block is 4 warps; a warp's channels are whole 16s");
  constexpr int BM = 32 * WM;
  extern __shared__ uint4 smem_u4[];
  T* sf = reinterpret_cast<T*>(smem_u4);
  T* sa = sf + g.cout * g.srow;  // [kStages][hr][hc][16]
  const int taps = g.r * g.s, kdim = taps * g.cin, row_vecs = kdim / 8;
  // The filter, 16 bytes a copy, all in flight at once: the first group.
  for (int i = threadIdx.x; i < g.cout * row_vecs; i += kThreads) {
    const int l = i / row_vecs, v = i - l * row_vecs;
    const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(sf + l * g.srow + 8 * v));
    const T* src = f + int64_t{phys_channel(l)} * kdim + 8 * v;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
  }
  asm volatile("cp.async.commit_group;\n" ::);

  const int slices = g.cin / 16, stage_elems = g.hr * g.hc * 16;
  const int row_tiles = static_cast<int>(g.oh) / g.tr, tiles = static_cast<int>(g.n) * row_tiles;
  const int mine = static_cast<int>(blockIdx.x) < tiles ? (tiles - 1 - static_cast<int>(blockIdx.x)) / gridDim.x + 1 : 0;
  const int total = mine * slices;  // this block's steps, over all its tiles
  // Stages step `st`'s halo (one group, empty past the end), 16 bytes a copy.
  auto issue = [&](int st) {
    if (st < total) {
      const int tile = static_cast<int>(blockIdx.x) + (st / slices) * static_cast<int>(gridDim.x);
      const int kc = 16 * (st % slices), n = tile / row_tiles, ih0 = (tile - n * row_tiles) * g.tr - g.ph;
      T* stage = sa + (st % kStages) * stage_elems;
      for (int i = threadIdx.x; i < 2 * g.hr * g.hc; i += kThreads) {
        const int hp = i >> 1, half = i & 1, hrow = hp / g.hc, hcol = hp - hrow * g.hc;
        const int ih = ih0 + hrow, iw = hcol - g.pw;
        const T* src = x;
        uint32_t bytes = 0;
        if (ih >= 0 && ih < g.h && iw >= 0 && iw < g.w) {
          src = x + ((int64_t{n} * g.h + ih) * g.w + iw) * g.cin + kc + 8 * half;
          bytes = 16;
        }
        const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(stage + hp * 16 + 8 * half));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
      }
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) issue(st);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tq = lane & 3;
  const int wm = warp % WM, wn = warp / WM;
  const int nb = wn * NT * 8;  // the warp's first logical output column
  const T* fb = sf + (nb + gr) * g.srow + 4 * tq;  // this thread's B row in n8 tile 0
  // The thread's four pixels (rows g, g + 8 of m16 tiles 0 and 1) as halo
  // positions of tap (0, 0).
  int hbase[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int p = 32 * wm + 16 * (q >> 1) + gr + 8 * (q & 1), ow = static_cast<int>(g.ow);
    hbase[q] = (p / ow) * g.hc + p % ow;
  }
  float acc[2][NT][4];
  for (int st = 0; st < total; ++st) {
    // Step st's halo has landed (at most kStages - 2 younger groups still in
    // flight), and every warp is done with step st - 1's, which issue() refills.
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2));
    __syncthreads();
    issue(st + kStages - 1);
    const int slice = st % slices;
    if (slice == 0) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][j][e] = 0.0f;
    }
    const T* stage = sa + (st % kStages) * stage_elems + 4 * tq;
    const T* fs = fb + 16 * slice;
    for (int r = 0; r < g.r; ++r)
      for (int s = 0; s < g.s; ++s) {
        const int off = r * g.hc + s;
        uint2 a[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) a[q] = *reinterpret_cast<const uint2*>(stage + (hbase[q] + off) * 16);
        const T* fk = fs + (r * g.s + s) * g.cin;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const uint2 b = *reinterpret_cast<const uint2*>(fk + 8 * j * g.srow);
#pragma unroll
          for (int mt = 0; mt < 2; ++mt)
            mma16816<T>(acc[mt][j], a[2 * mt].x, a[2 * mt + 1].x, a[2 * mt].y, a[2 * mt + 1].y, b.x, b.y);
        }
      }
    if (slice != slices - 1) continue;
    struct alignas(8) Pack4 {
      T v[4];
    };
    // The tile is tr whole rows: its pixels are BM consecutive ones.
    const int64_t m0 = int64_t{static_cast<int>(blockIdx.x) + (st / slices) * static_cast<int>(gridDim.x)} * BM;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int mt = q >> 1, hh = q & 1;
      T* out = y + (m0 + 32 * wm + 16 * mt + gr + 8 * hh) * g.cout + nb + 4 * tq;
#pragma unroll
      for (int jj = 0; jj < NT / 2; ++jj) {
        Pack4 pk;
        pk.v[0] = convert<T>(acc[mt][2 * jj][2 * hh]);
        pk.v[1] = convert<T>(acc[mt][2 * jj][2 * hh + 1]);
        pk.v[2] = convert<T>(acc[mt][2 * jj + 1][2 * hh]);
        pk.v[3] = convert<T>(acc[mt][2 * jj + 1][2 * hh + 1]);
        reinterpret_cast<Pack4*>(out + 16 * jj)[0] = pk;
      }
    }
  }
  asm volatile("cp.async.wait_group 0;\n" ::);
}

bool output_channels_ok(int64_t c) { return c == 16 || c == 32 || c == 64 || c == 96 || c == 128 || c == 160; }

// Pixels a tile: 32 per warp along M (4 warps for 16 or 32 output channels,
// else 2).
int tile_pixels(int64_t out_channels) { return out_channels <= 32 ? 128 : 64; }

// Whether the kernel computes `reduce` input channels into `out` output
// channels over an r x s filter, at an output of oh x ow pixels an image.
bool shape_ok(int64_t reduce, int64_t out, int64_t r, int64_t s, int64_t oh, int64_t ow) {
  if (reduce % 16 != 0 || reduce <= 0 || !output_channels_ok(out) || std::min(reduce, out) > 32) return false;
  if (r * s * reduce > 16 * 1024) return false;
  if (static_cast<size_t>(out) * filter_row(static_cast<int>(r * s * reduce)) * 2 > kMaxFilterBytes) return false;
  // Tiles of whole rows, m16 tiles inside a row.
  const int64_t bm = tile_pixels(out);
  if (ow % 16 != 0 || bm % ow != 0 || oh % (bm / ow) != 0) return false;
  return static_cast<size_t>((bm / ow + r - 1) * (ow + s - 1)) * 32 <= kMaxStageBytes;
}

template <typename T, int WM, int WN, int NT>
void launch_config(const T* x, const T* f, T* y, const MGeom& g, int device, cudaStream_t stream) {
  auto kernel = mma_conv_kernel<T, WM, WN, NT>;
  const size_t smem = (static_cast<size_t>(g.cout) * g.srow + static_cast<size_t>(kStages) * g.hr * g.hc * 16) * sizeof(T);
  // Per instantiation and device: the larger shared memory asked for once.
  static std::atomic<bool> opted_in[kMaxDevices];
  if (device >= kMaxDevices || !opted_in[device].load(std::memory_order_acquire)) {
    CHORUS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(kMaxSmemBytes)));
    if (device < kMaxDevices) opted_in[device].store(true, std::memory_order_release);
  }
  int per_sm = 0;
  CHORUS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
  const int64_t tiles = g.n * (g.oh / g.tr);
  const int64_t blocks =
      std::clamp<int64_t>(tiles, 1, int64_t{std::max(per_sm, 1)} * device_properties(device).multiProcessorCount);
  kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(x, f, y, g);
  CHORUS_CUDA_LAUNCH_CHECK();
}

template <typename T>
void launch(const T* x, const T* f, T* y, const MGeom& g, int device) {
  cudaStream_t stream = current_stream(device);
  switch (g.cout) {
    case 16: return launch_config<T, 4, 1, 2>(x, f, y, g, device, stream);
    case 32: return launch_config<T, 4, 1, 4>(x, f, y, g, device, stream);
    case 64: return launch_config<T, 2, 2, 4>(x, f, y, g, device, stream);
    case 96: return launch_config<T, 2, 2, 6>(x, f, y, g, device, stream);
    case 128: return launch_config<T, 2, 2, 8>(x, f, y, g, device, stream);
    case 160: return launch_config<T, 2, 2, 10>(x, f, y, g, device, stream);
    default: CHORUS_CHECK(false, "conv_mma: ", g.cout, " output channels");
  }
}

void run(const Tensor& in, const Tensor& filter, const Tensor& out, const MGeom& g) {
  dispatch_float(in.dtype(), "conv_mma", [&]<typename T>() {
    if constexpr (sizeof(T) == 2)
      launch(static_cast<const T*>(in.raw_data()), static_cast<const T*>(filter.raw_data()),
             static_cast<T*>(out.raw_data()), g, in.device().index);
  });
}

// m with its tiles' rows and halo filled in.
MGeom with_tiles(MGeom m) {
  m.tr = tile_pixels(m.cout) / static_cast<int>(m.ow);
  m.hr = m.tr + m.r - 1;
  m.hc = static_cast<int>(m.ow) + m.s - 1;
  return m;
}

bool aligned(const Tensor& t, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(t.raw_data()) % bytes == 0; }

PathSwitch& path_switch() {
  static PathSwitch* sw = new PathSwitch("CHORUS_CONV_MMA");  // leaked: read from any thread until exit
  return *sw;
}

std::atomic<int64_t> mma_runs{0};

}  // namespace

bool conv_mma_enabled() { return path_switch().on(); }
int64_t conv_mma_runs() { return mma_runs.load(std::memory_order_relaxed); }
void set_conv_mma_enabled(bool on) { path_switch().set(on); }

bool conv_mma_applies(const Conv2dGeometry& g, Layout layout, DType dtype) {
  if (layout != Layout::NHWC || (dtype != kBFloat16 && dtype != kFloat16) || g.groups != 1 || g.stride_h != 1 ||
      g.stride_w != 1 || g.dil_h != 1 || g.dil_w != 1 || g.n <= 0 || g.out_h() <= 0 || g.out_w() <= 0)
    return false;
  // Pixels and elements index as int inside the kernel.
  if (g.n * std::max(g.h * g.w, g.out_h() * g.out_w()) * std::max(g.c_in, g.c_out) >= (int64_t{1} << 31)) return false;
  return shape_ok(g.c_in, g.c_out, g.kh, g.kw, g.out_h(), g.out_w());
}

bool conv_mma_aligned(const Tensor& in, const Tensor& w, const Tensor& out) {
  return aligned(in, 8) && aligned(w, 16) && aligned(out, 8);
}

void conv_mma_forward(const Conv2dGeometry& g, const Tensor& x, const Tensor& w, const Tensor& y) {
  CHORUS_CHECK(conv_mma_applies(g, Layout::NHWC, x.dtype()) && w.dtype() == x.dtype() &&
                   y.dtype() == x.dtype() && conv_mma_aligned(x, w, y),
               "conv_mma_forward: not a convolution the tensor-core kernel computes: ", x.describe(), ", ",
               w.describe(), ", ", y.describe());
  mma_runs.fetch_add(1, std::memory_order_relaxed);
  const MGeom m{g.n, g.h, g.w, g.out_h(), g.out_w(), static_cast<int>(g.c_in), static_cast<int>(g.c_out),
                static_cast<int>(g.kh), static_cast<int>(g.kw), static_cast<int>(g.pad_h), static_cast<int>(g.pad_w),
                filter_row(static_cast<int>(g.kh * g.kw * g.c_in))};
  run(x, w, y, with_tiles(m));
}

}  // namespace chorus::cuda
