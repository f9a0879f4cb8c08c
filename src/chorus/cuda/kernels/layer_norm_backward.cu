// Layer norm's backward on CUDA: dx with the parameter gradients in one pass
// (Note [Layer norm's backward in one pass]), or for rows past kFusedMaxCols
// dx and then the parameter gradients in a second kernel. The forward is
// layer_norm_forward.cu; the helpers both share, layer_norm.cuh.
#include "chorus/cuda/kernels/layer_norm.cuh"

namespace chorus::cuda {

namespace {

// Two sums of a row at once.
struct SumPairV {
  float a, b;
  __device__ static SumPairV merge(SumPairV p, SumPairV q) { return {p.a + q.a, p.b + q.b}; }
  __device__ SumPairV shfl(int mask) const { return {shfl_xor(a, mask), shfl_xor(b, mask)}; }
};

// dx = rs * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) + dres, dxhat =
// dy * gamma, xhat = (x - mean) * rs: the two helpers below are a row's
// per-vector work, shared by layer_norm_dx_kernel and
// layer_norm_backward_fused_kernel so that both paths round dx alike. d and
// v are vector c of the row's dy and x (loaded by the caller: Note [Layer
// norm's backward from registers]), gamma null means 1.

// Adds vector c's terms of the row sums: s.a of dxhat, s.b of dxhat * xhat.
template <typename T, typename G, int V>
__device__ __forceinline__ void layer_norm_add_row_sums(const Vec<T, V>& d, const Vec<T, V>& v,
                                                        const G* __restrict__ gamma, int64_t c, float m, float rs,
                                                        SumPairV& s) {
  float gm[V];
  load_params<G, V>(gamma, c * V, 1.0f, gm);
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float g = to_acc(d.v[j]) * gm[j];
    s.a += g;
    s.b += g * (to_acc(v.v[j]) - m) * rs;
  }
}

// dx's vector c, given the row's sums s (all-reduced) and inv = 1 / cols, plus
// the residual gradient's vector e where has_e. With kParamSums it
// also adds the V columns' parameter-gradient terms, dy * xhat to pg[j] and
// dy to pb[j] (Note [Layer norm's backward in one pass]).
template <bool kParamSums, typename T, typename G, int V>
__device__ __forceinline__ Vec<T, V> layer_norm_dx_vector(const Vec<T, V>& d, const Vec<T, V>& v, bool has_e,
                                                          const Vec<T, V>& e, const G* __restrict__ gamma, int64_t c,
                                                          float m, float rs, SumPairV s, float inv, float* pg,
                                                          float* pb) {
  float gm[V];
  load_params<G, V>(gamma, c * V, 1.0f, gm);
  Vec<T, V> out;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float dj = to_acc(d.v[j]);
    const float g = dj * gm[j];
    const float xhat = (to_acc(v.v[j]) - m) * rs;
    out.v[j] = convert<T>(rs * (g - s.a * inv - xhat * s.b * inv));
    if constexpr (kParamSums) {
      pg[j] += dj * xhat;
      pb[j] += dj;
    }
  }
  if (has_e) {
    // Rounded once to T before the add, as a separate add of dx and dres
    // would see them: the fused op equals the composition.
#pragma unroll
    for (int j = 0; j < V; ++j) out.v[j] = convert<T>(to_acc(out.v[j]) + to_acc(e.v[j]));
  }
  return out;
}

// dx a row at a time; dres (the residual stream's gradient) may be null.
template <typename T, typename G, int V>
__global__ void layer_norm_dx_kernel(const T* dy, const T* x, const G* gamma, const float* mean, const float* rstd,
                                     const T* dres, T* dx, int64_t rows, int64_t cols) {
  const int64_t row = row_index();
  if (row >= rows) return;
  const int64_t nv = cols / V;
  const Vec<T, V>* dyr = reinterpret_cast<const Vec<T, V>*>(dy + row * cols);
  const Vec<T, V>* xr = reinterpret_cast<const Vec<T, V>*>(x + row * cols);
  const float m = mean[row], rs = rstd[row];
  SumPairV s{0.0f, 0.0f};
  for (int64_t c = threadIdx.x; c < nv; c += blockDim.x) layer_norm_add_row_sums(dyr[c], xr[c], gamma, c, m, rs, s);
  s = row_allreduce(s);
  const float inv = 1.0f / static_cast<float>(cols);
  Vec<T, V>* dxr = reinterpret_cast<Vec<T, V>*>(dx + row * cols);
  const Vec<T, V>* drr = reinterpret_cast<const Vec<T, V>*>(dres ? dres + row * cols : nullptr);
  for (int64_t c = threadIdx.x; c < nv; c += blockDim.x) {
    Vec<T, V> e;
    if (drr) e = drr[c];
    dxr[c] = layer_norm_dx_vector<false>(dyr[c], xr[c], drr != nullptr, e, gamma, c, m, rs, s, inv, nullptr, nullptr);
  }
}

// Note [Layer norm's backward in one pass]: dgamma = sum over rows of dy *
// xhat and dbeta = sum of dy need the same dy and x that dx reads, so they are
// summed in dx's pass (layer_norm_backward_fused_kernel) instead of by a
// second kernel that reads both again: for GPT-2's [16384, 768] bf16, 50 MB
// fewer bytes a call (llm.c's layernorm_backward_kernel10 does the same).
//
// The layout is row_launch's (a warp per row up to kWarpCols columns,
// kRowsPerBlock rows a block; else a block per row, here of R threads, whole
// warps, as few as own the row), but the grid is bounded to the blocks that
// fit on the GPU at once (the occupancy query) and each warp or block strides
// over the rows. So every thread keeps the same columns, vectors threadIdx.x +
// k * blockDim.x, for all its rows and sums their dgamma and dbeta terms in
// registers: kFusedColsPerThread floats of each (K = 32 / V vectors), which
// bounds the fused path to kFusedMaxCols columns; longer rows take the two
// kernels (layer_norm_dx_kernel, then layer_norm_param_grad_kernel). At the
// end the warps of a block add their sums in shared memory in warp order,
// each block writes one row of dgamma and one of dbeta partials to a float32
// scratch of [2, blocks, cols] (from the caching allocator: a captured graph
// keeps it, nothing is synchronized), and layer_norm_param_sum_kernel adds the
// blocks' rows in a fixed order and writes dgamma and dbeta. No atomics: the
// sums are the same from run to run (the grid depends only on the device, the
// dtypes and the shape). The outputs are written, not added to: the launcher
// zeroed them before the atomics of the two-kernel path added to them, and
// still does on that path; the op layer hands fresh tensors either way.
//
// The register sums cost occupancy: at V = 8 the kernel takes about 127
// registers (two blocks of 256 an SM; asking for three spills), at V = 1 about
// 180 (one). Measured on an H200 with a standalone harness (these kernels,
// bf16 x, float32 gamma, 100 calls): [16384, 768] with dres 69 -> 52 us a
// call against the two kernels, without dres 65 -> 43 us; [16384, 1600] (a
// block of 64 threads a row) 129 -> 130 us, no gain there.
//
// Note [Layer norm's backward from registers]: dy, x, dres, dx and partial
// are __restrict__, so the compiler may move the row's loads (and the next
// row's) past dx's stores and keep the first pass's values for the second
// where registers allow; gamma is read as 16-byte vectors (the helpers, also
// for layer_norm_dx_kernel); and the kernel is instanced on K, the vectors a
// thread owns (1, 2, 3, 4, or kFusedColsPerThread / V; that alone for V =
// 1), so that GPT-2's 768 bf16 columns (3 vectors a lane) hold 3 vectors'
// dgamma and dbeta sums, not 4. Loading the row's dy, x and dres into
// register arrays first, as Note [Layer norm's forward from registers] does,
// took ptxas 173 registers at K = 3 (bf16) and 223 at K = 4, one block of 256
// an SM, or spilled under __launch_bounds__(256, 2): the per-thread
// parameter sums leave no room. Same sums in the same order as before, so
// the same bits. Measured on an H200 (session 42's harness): [16384, 768]
// bf16 with dres 51 us a call, 2.0 TB/s; rows of up to 1024 columns in 16-byte
// vectors of 4 or more elements now take layer_norm_backward_warp_kernel
// (Note [Layer norm's backward, sums in shared memory]), this kernel the
// longer rows, doubles and unaligned rows.
constexpr int kFusedColsPerThread = 32;
constexpr int64_t kFusedMaxCols = int64_t{kFusedColsPerThread} * kBlockThreads;  // 8192

// dx as layer_norm_dx_kernel, plus this block's dgamma and dbeta partials
// (Note [Layer norm's backward in one pass]): partial[blockIdx.x * cols + c]
// and partial[(gridDim.x + blockIdx.x) * cols + c]. Launched with blockDim
// (32, kRowsPerBlock) and 2 * kRowsPerBlock * 32 * V floats of dynamic shared
// memory, or (R, 1) with R * kFusedColsPerThread >= cols and none.
template <int K, typename T, typename G, int V>
__global__ void __launch_bounds__(kBlockThreads)
    layer_norm_backward_fused_kernel(const T* __restrict__ dy, const T* __restrict__ x, const G* __restrict__ gamma,
                                     const float* __restrict__ mean, const float* __restrict__ rstd,
                                     const T* __restrict__ dres, T* __restrict__ dx, float* __restrict__ partial,
                                     int64_t rows, int64_t cols) {
  // K: vectors of a row this thread owns, threadIdx.x + k * blockDim.x.
  static_assert(K * V <= kFusedColsPerThread);
  const int64_t nv = cols / V;
  float pg[K][V], pb[K][V];
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int j = 0; j < V; ++j) pg[k][j] = pb[k][j] = 0.0f;
  const float inv = 1.0f / static_cast<float>(cols);
  const int64_t row_stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  // The loop's bound is the same for every thread of a row (a warp, or the
  // whole block where row_allreduce synchronizes it).
  for (int64_t row = row_index(); row < rows; row += row_stride) {
    const Vec<T, V>* dyr = reinterpret_cast<const Vec<T, V>*>(dy + row * cols);
    const Vec<T, V>* xr = reinterpret_cast<const Vec<T, V>*>(x + row * cols);
    const Vec<T, V>* drr = reinterpret_cast<const Vec<T, V>*>(dres ? dres + row * cols : nullptr);
    const float m = mean[row], rs = rstd[row];
    SumPairV s{0.0f, 0.0f};
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t c = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (c < nv) layer_norm_add_row_sums(dyr[c], xr[c], gamma, c, m, rs, s);
    }
    s = row_allreduce(s);
    Vec<T, V>* dxr = reinterpret_cast<Vec<T, V>*>(dx + row * cols);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t c = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (c < nv) {
        Vec<T, V> e;
        if (drr) e = drr[c];
        dxr[c] = layer_norm_dx_vector<true>(dyr[c], xr[c], drr != nullptr, e, gamma, c, m, rs, s, inv, pg[k], pb[k]);
      }
    }
  }
  float* part_g = partial + static_cast<int64_t>(blockIdx.x) * cols;
  float* part_b = partial + (static_cast<int64_t>(gridDim.x) + blockIdx.x) * cols;
  if (blockDim.y == 1) {
    // A block per row: its threads own disjoint columns.
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t c = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (c < nv) {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          part_g[c * V + j] = pg[k][j];
          part_b[c * V + j] = pb[k][j];
        }
      }
    }
    return;
  }
  // A warp per row: the block's kRowsPerBlock warps own the same columns,
  // added a vector slot k (32 * V columns from k * 32 * V) at a time.
  extern __shared__ float ln_fused_smem[];
  float* sg = ln_fused_smem;                           // [kRowsPerBlock][32 * V]
  float* sb = ln_fused_smem + kRowsPerBlock * 32 * V;  // [kRowsPerBlock][32 * V]
  const int tid = threadIdx.y * 32 + threadIdx.x;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (static_cast<int64_t>(k) * 32 >= nv) break;  // the same for the whole block
#pragma unroll
    for (int j = 0; j < V; ++j) {
      sg[threadIdx.y * 32 * V + threadIdx.x * V + j] = pg[k][j];
      sb[threadIdx.y * 32 * V + threadIdx.x * V + j] = pb[k][j];
    }
    __syncthreads();
    for (int i = tid; i < 32 * V; i += 32 * kRowsPerBlock) {
      const int64_t col = static_cast<int64_t>(k) * 32 * V + i;
      if (col < cols) {
        float g = 0.0f, b = 0.0f;
        for (int w = 0; w < kRowsPerBlock; ++w) {
          g += sg[w * 32 * V + i];
          b += sb[w * 32 * V + i];
        }
        part_g[col] = g;
        part_b[col] = b;
      }
    }
    __syncthreads();
  }
}

// Note [Layer norm's backward, sums in shared memory]: in the warp-a-row
// layout (rows up to kWarpCols columns, 16-byte vectors of at least 4
// elements) the per-thread dgamma and dbeta sums of
// layer_norm_backward_fused_kernel -- 2 K V floats a thread -- move to shared
// memory, one slice a warp (its lanes own disjoint float4 slots, lane
// fastest: no bank conflicts, no atomics), and the registers they held take
// the row instead: dy, x and dres are all loaded before the row sums, one
// round trip to memory a row where the register-sum kernel waited twice (dres
// was loaded after the row's all-reduce); and the warp asks L2 for its next
// row (prefetch.global.L2, no registers) while it works on this one. Same
// sums in the same row order within a warp and the same warp order within a
// block, so the kernel is as deterministic as the other.
// Measured with a standalone harness on an H200 (bf16 x, dres, float32
// gamma, with layer_norm_param_sum_kernel, 200 calls; benchmarks journal,
// session 42): [16384, 768] 50.9 us a call -> 42.1 with the sums in shared
// memory -> 38.7 with the prefetch; [16384, 1024] 66.8 -> 58.2 -> 55.1.
// Asking for 3 or 4 blocks an SM instead of 2 (80 or 64 registers) spilled
// and ran 1.5-2.5x slower; keeping the sums in registers with all three
// loads first took 170 registers and one block an SM, 55.4 us.
template <int K, typename T, typename G, int V>
__global__ void __launch_bounds__(kBlockThreads, 2)
    layer_norm_backward_warp_kernel(const T* __restrict__ dy, const T* __restrict__ x, const G* __restrict__ gamma,
                                    const float* __restrict__ mean, const float* __restrict__ rstd,
                                    const T* __restrict__ dres, T* __restrict__ dx, float* __restrict__ partial,
                                    int64_t rows, int64_t cols) {
  static_assert(V % 4 == 0, "the sums' slots are float4s");
  constexpr int Q = V / 4;            // float4 slots of a vector
  constexpr int kSlots = K * Q * 32;  // a warp's float4 slots of dgamma (and as many of dbeta)
  extern __shared__ float4 ln_warp_sums[];  // [warp][dgamma, dbeta][K][Q][lane]
  float4* sg = ln_warp_sums + threadIdx.y * 2 * kSlots;
  float4* sb = sg + kSlots;
  const int lane = threadIdx.x;
#pragma unroll
  for (int i = 0; i < K * Q; ++i) sg[i * 32 + lane] = sb[i * 32 + lane] = make_float4(0.f, 0.f, 0.f, 0.f);
  const int64_t nv = cols / V;
  const float inv = 1.0f / static_cast<float>(cols);
  const int64_t row_stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t row = row_index(); row < rows; row += row_stride) {
    const Vec<T, V>* dyr = reinterpret_cast<const Vec<T, V>*>(dy + row * cols);
    const Vec<T, V>* xr = reinterpret_cast<const Vec<T, V>*>(x + row * cols);
    const Vec<T, V>* drr = reinterpret_cast<const Vec<T, V>*>(dres ? dres + row * cols : nullptr);
    Vec<T, V> d[K], v[K], e[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t c = lane + static_cast<int64_t>(k) * 32;
      if (c < nv) {
        d[k] = dyr[c];
        v[k] = xr[c];
        if (drr) e[k] = drr[c];
      }
    }
    {
      const int64_t next = row + row_stride;
      if (next < rows) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
          const int64_t c = (lane + static_cast<int64_t>(k) * 32) * V;
          if (c < cols) {
            asm volatile("prefetch.global.L2 [%0];" ::"l"(dy + next * cols + c));
            asm volatile("prefetch.global.L2 [%0];" ::"l"(x + next * cols + c));
            if (dres) asm volatile("prefetch.global.L2 [%0];" ::"l"(dres + next * cols + c));
          }
        }
      }
    }
    const float m = mean[row], rs = rstd[row];
    SumPairV s{0.0f, 0.0f};
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t c = lane + static_cast<int64_t>(k) * 32;
      if (c < nv) layer_norm_add_row_sums(d[k], v[k], gamma, c, m, rs, s);
    }
    // A warp's row: shuffles only (row_allreduce's shared memory for block
    // rows would count against the launch's 48 KiB).
#pragma unroll
    for (int mask = 16; mask > 0; mask /= 2) s = SumPairV::merge(s, s.shfl(mask));
    Vec<T, V>* dxr = reinterpret_cast<Vec<T, V>*>(dx + row * cols);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t c = lane + static_cast<int64_t>(k) * 32;
      if (c < nv) {
        float pg[V], pb[V];
#pragma unroll
        for (int j = 0; j < V; ++j) pg[j] = pb[j] = 0.0f;
        dxr[c] = layer_norm_dx_vector<true>(d[k], v[k], drr != nullptr, e[k], gamma, c, m, rs, s, inv, pg, pb);
#pragma unroll
        for (int q = 0; q < Q; ++q) {
          float4 g = sg[(k * Q + q) * 32 + lane], b = sb[(k * Q + q) * 32 + lane];
          g.x += pg[4 * q];
          g.y += pg[4 * q + 1];
          g.z += pg[4 * q + 2];
          g.w += pg[4 * q + 3];
          b.x += pb[4 * q];
          b.y += pb[4 * q + 1];
          b.z += pb[4 * q + 2];
          b.w += pb[4 * q + 3];
          sg[(k * Q + q) * 32 + lane] = g;
          sb[(k * Q + q) * 32 + lane] = b;
        }
      }
    }
  }
  // The block's warps' sums, in warp order, one row of partials each.
  __syncthreads();
  float* part_g = partial + static_cast<int64_t>(blockIdx.x) * cols;
  float* part_b = partial + (static_cast<int64_t>(gridDim.x) + blockIdx.x) * cols;
  for (int i = threadIdx.y * 32 + lane; i < kSlots; i += 32 * blockDim.y) {
    const int kq = i / 32, k = kq / Q, q = kq % Q;
    const int64_t col = static_cast<int64_t>(k) * 32 * V + (i % 32) * V + q * 4;
    if (col < cols) {
      float4 g = make_float4(0.f, 0.f, 0.f, 0.f), b = g;
      for (int w = 0; w < static_cast<int>(blockDim.y); ++w) {
        const float4 gw = ln_warp_sums[w * 2 * kSlots + i], bw = ln_warp_sums[w * 2 * kSlots + kSlots + i];
        g.x += gw.x;
        g.y += gw.y;
        g.z += gw.z;
        g.w += gw.w;
        b.x += bw.x;
        b.y += bw.y;
        b.z += bw.z;
        b.w += bw.w;
      }
      *reinterpret_cast<float4*>(part_g + col) = g;
      *reinterpret_cast<float4*>(part_b + col) = b;
    }
  }
}

constexpr int kSumRowWarps = 16;  // warps of layer_norm_param_sum_kernel's block, each over its own partials

// dgamma[c] = sum over p of partial[p * cols + c], dbeta[c] = the same over
// partial[(parts + p) * cols + c], in p order within a warp and warp order
// after: block (32, kSumRowWarps), 32 columns a block.
__global__ void layer_norm_param_sum_kernel(const float* partial, int64_t parts, int64_t cols, float* dgamma,
                                            float* dbeta) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float g = 0.0f, b = 0.0f;
  if (c < cols) {
    for (int64_t p = threadIdx.y; p < parts; p += kSumRowWarps) {
      g += partial[p * cols + c];
      b += partial[(parts + p) * cols + c];
    }
  }
  __shared__ float sg[kSumRowWarps][32], sb[kSumRowWarps][32];
  sg[threadIdx.y][threadIdx.x] = g;
  sb[threadIdx.y][threadIdx.x] = b;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    for (int w = 1; w < kSumRowWarps; ++w) {
      g += sg[w][threadIdx.x];
      b += sb[w][threadIdx.x];
    }
    if (dgamma) dgamma[c] = g;
    if (dbeta) dbeta[c] = b;
  }
}

// The two-kernel path for rows longer than kFusedMaxCols: dx by
// layer_norm_dx_kernel, then the parameter gradients read dy and x again.
constexpr int kParamCols = 32;     // column vectors per block (one per lane)
constexpr int kParamRowWarps = 8;  // warps per block, each over its own rows

// dgamma[c] += sum over this block's rows of dy * xhat; dbeta[c] += sum of dy,
// for the V columns of a lane's 16-byte vector.
template <typename T, int V>
__global__ void layer_norm_param_grad_kernel(const T* dy, const T* x, const float* mean, const float* rstd,
                                             float* dgamma, float* dbeta, int64_t rows, int64_t cols,
                                             int64_t rows_per_block) {
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kParamCols + threadIdx.x) * V;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_block;
  const int64_t r1 = r0 + rows_per_block < rows ? r0 + rows_per_block : rows;
  float g[V], b[V];
#pragma unroll
  for (int j = 0; j < V; ++j) g[j] = b[j] = 0.0f;
  if (c < cols) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += blockDim.y) {
      const Vec<T, V> d = *reinterpret_cast<const Vec<T, V>*>(dy + r * cols + c);
      const Vec<T, V> v = *reinterpret_cast<const Vec<T, V>*>(x + r * cols + c);
      const float m = mean[r], rs = rstd[r];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float dj = to_acc(d.v[j]);
        g[j] += dj * (to_acc(v.v[j]) - m) * rs;
        b[j] += dj;
      }
    }
  }
  __shared__ float sg[kParamRowWarps][kParamCols * V], sb[kParamRowWarps][kParamCols * V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    sg[threadIdx.y][threadIdx.x * V + j] = g[j];
    sb[threadIdx.y][threadIdx.x * V + j] = b[j];
  }
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      float gs = g[j], bs = b[j];
      for (int w = 1; w < kParamRowWarps; ++w) {
        gs += sg[w][threadIdx.x * V + j];
        bs += sb[w][threadIdx.x * V + j];
      }
      if (dgamma) atomicAdd(dgamma + c + j, gs);
      if (dbeta) atomicAdd(dbeta + c + j, bs);
    }
  }
}

// layer_norm_backward_fused_kernel's instance for rows where each thread
// owns per_thread <= kMaxK vectors: K = 1, 2, 3, 4 or kMaxK (Note [Layer
// norm's backward from registers]); kMaxK alone for V = 1.
template <int kMaxK, typename T, typename G, int V>
auto fused_backward_kernel(int64_t per_thread) {
  if constexpr (V > 1 && kMaxK >= 4) {
    if (per_thread <= 1) return layer_norm_backward_fused_kernel<1, T, G, V>;
    if (per_thread <= 2) return layer_norm_backward_fused_kernel<2, T, G, V>;
    if (per_thread <= 3) return layer_norm_backward_fused_kernel<3, T, G, V>;
    if (per_thread <= 4) return layer_norm_backward_fused_kernel<4, T, G, V>;
  }
  return layer_norm_backward_fused_kernel<kMaxK, T, G, V>;
}

// layer_norm_backward_warp_kernel's instance for K = per_thread vectors a
// lane (1 to 4, or 8 for 4-element vectors).
template <typename T, typename G, int V>
auto warp_backward_kernel(int64_t per_thread) {
  if (per_thread <= 1) return layer_norm_backward_warp_kernel<1, T, G, V>;
  if (per_thread <= 2) return layer_norm_backward_warp_kernel<2, T, G, V>;
  if (per_thread <= 3) return layer_norm_backward_warp_kernel<3, T, G, V>;
  if constexpr (V == 4) {
    if (per_thread > 4) return layer_norm_backward_warp_kernel<8, T, G, V>;
  }
  return layer_norm_backward_warp_kernel<4, T, G, V>;
}

}  // namespace

void layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                         const Tensor& rstd, const Tensor& dres, const Tensor& dx, const Tensor& dgamma,
                         const Tensor& dbeta) {
  const char* op = "layer_norm_backward";
  check_cuda_contiguous(x, op, "x");
  check_cuda_contiguous(dy, op, "dy");
  check_cuda_contiguous(dx, op, "dx");
  CHORUS_CHECK(dy.dtype() == x.dtype() && dx.dtype() == x.dtype(), op, ": dy, x and dx must share a dtype");
  if (dres.defined()) {
    check_cuda_contiguous(dres, op, "dres");
    CHORUS_CHECK(dres.dtype() == x.dtype() && dres.sizes() == x.sizes(), op, ": dres must be x's shape and dtype, got ",
                 dres.describe());
  }
  CHORUS_CHECK((!dgamma.defined() || dgamma.dtype() == kFloat32) && (!dbeta.defined() || dbeta.dtype() == kFloat32),
               op, ": dgamma and dbeta must be float32 on CUDA");
  const int64_t rows = rows_of(x), cols = x.size(-1);
  const int dev = x.device().index;
  CudaDeviceGuard guard(dev);
  cudaStream_t stream = current_stream(dev);
  float* dg = dgamma.defined() ? dgamma.data<float>() : nullptr;
  float* db = dbeta.defined() ? dbeta.data<float>() : nullptr;
  // dgamma and dbeta are written whole (zeros for no rows), never added to.
  const bool params = dg || db, fused = params && rows > 0 && cols <= kFusedMaxCols;
  if (params && !fused) {
    if (dg) CHORUS_CUDA_CHECK(cudaMemsetAsync(dg, 0, cols * sizeof(float), stream));
    if (db) CHORUS_CUDA_CHECK(cudaMemsetAsync(db, 0, cols * sizeof(float), stream));
  }
  if (rows == 0) return;
  dispatch_float(x.dtype(), op, [&]<typename T>() {
    with_param_type<T>(gamma, Tensor(), x.dtype(), op, [&]<typename G>() {
      const T* dr = dres.defined() ? dres.data<T>() : nullptr;
      // gamma too: the helpers read it a 16-byte vector at a time.
      with_row_vector<T>(cols, {dy.raw_data(), x.raw_data(), dx.raw_data(), dr, param_ptr<G>(gamma)}, [&]<int V>() {
        if (fused) {
          // Note [Layer norm's backward in one pass]: row_launch's layout, R
          // threads a long row (whole warps, enough that each owns at most
          // kFusedColsPerThread columns), as many blocks as fit at once.
          constexpr int kMaxK = kFusedColsPerThread / V;
          const int64_t nv = cols / V;
          const bool warp_rows = cols <= kWarpCols;
          // Runs one of the one-pass kernels over as many blocks as fit on
          // the GPU at once, then adds the blocks' partial sums.
          auto run = [&](auto kernel, dim3 block, size_t smem) {
            int per_sm = 0;
            const int threads = static_cast<int>(block.x * block.y);
            CHORUS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
            const int64_t resident = int64_t{std::max(per_sm, 1)} * device_properties(dev).multiProcessorCount;
            const int64_t blocks = std::clamp<int64_t>((rows + block.y - 1) / block.y, 1, resident);
            // Freed on this stream after the kernels below: stream order makes it safe.
            Tensor partial = detail::empty_tensor({2 * blocks * cols}, kFloat32, x.device());
            kernel<<<static_cast<unsigned>(blocks), block, smem, stream>>>(
                dy.data<T>(), x.data<T>(), param_ptr<G>(gamma), mean.data<float>(), rstd.data<float>(), dr,
                dx.data<T>(), partial.data<float>(), rows, cols);
            CHORUS_CUDA_LAUNCH_CHECK();
            layer_norm_param_sum_kernel<<<static_cast<unsigned>((cols + 31) / 32), dim3(32, kSumRowWarps), 0,
                                          stream>>>(partial.data<float>(), blocks, cols, dg, db);
          };
          if constexpr (V % 4 == 0) {
            if (warp_rows) {
              // Note [Layer norm's backward, sums in shared memory].
              const int64_t per_lane = (nv + 31) / 32;
              const size_t smem = size_t{kRowsPerBlock} * 2 * static_cast<size_t>(per_lane <= 4 ? per_lane : 8) *
                                  (V / 4) * 32 * sizeof(float4);
              auto kernel = warp_backward_kernel<T, G, V>(per_lane);
              // Up to 64 KiB (8 warps x 2 x 4 vectors of 8 floats x 32 lanes):
              // past the 48 KiB a launch gets without asking.
              CHORUS_CUDA_CHECK(
                  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
              run(kernel, dim3(32, kRowsPerBlock), smem);
              return;
            }
          }
          const dim3 block = warp_rows ? dim3(32, kRowsPerBlock)
                                       : dim3(static_cast<unsigned>(((nv + kMaxK - 1) / kMaxK + 31) / 32 * 32), 1);
          const size_t smem = warp_rows ? 2 * kRowsPerBlock * 32 * V * sizeof(float) : 0;
          run(fused_backward_kernel<kMaxK, T, G, V>((nv + block.x - 1) / block.x), block, smem);
          return;
        }
        const RowLaunch l = row_launch(rows, cols);
        layer_norm_dx_kernel<T, G, V><<<l.grid, l.block, 0, stream>>>(dy.data<T>(), x.data<T>(), param_ptr<G>(gamma),
                                                                     mean.data<float>(), rstd.data<float>(), dr,
                                                                     dx.data<T>(), rows, cols);
      });
    });
    if (params && !fused) {
      with_row_vector<T>(cols, {dy.raw_data(), x.raw_data()}, [&]<int V>() {
        // Enough row blocks to fill the GPU (about 4 blocks an SM over the column tiles).
        const int64_t col_blocks = (cols + kParamCols * V - 1) / (kParamCols * V);
        const int64_t want = std::max<int64_t>(1, 528 / col_blocks);
        const int64_t rows_per_block = std::max<int64_t>(kParamRowWarps, (rows + want - 1) / want);
        const dim3 grid(static_cast<unsigned>(col_blocks),
                        static_cast<unsigned>((rows + rows_per_block - 1) / rows_per_block));
        layer_norm_param_grad_kernel<T, V><<<grid, dim3(kParamCols, kParamRowWarps), 0, stream>>>(
            dy.data<T>(), x.data<T>(), mean.data<float>(), rstd.data<float>(), dg, db, rows, cols, rows_per_block);
      });
    }
  });
  CHORUS_CUDA_LAUNCH_CHECK();
}

}  // namespace chorus::cuda
