// The transformer's row-wise kernels on CUDA: layer norm, attention's (causal)
// softmax and the fused classifier + cross entropy (as cpu/transformer.cpp,
// float math throughout). Rows are laid out over warps or blocks as
// cuda/kernels/row_reduce.cuh says.
//
// Layer norm's parameter gradients are column sums over every row, taken in
// the same pass as dx (Note [Layer norm's backward in one pass]) into float32
// dgamma and dbeta (the op layer converts them afterwards where gamma is
// 16-bit).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>

#include "chorus/cuda/runtime/context.h"
#include "chorus/cuda/kernels/dtype_dispatch.cuh"
#include "chorus/cuda/kernels/kernels.h"
#include "chorus/cuda/kernels/row_reduce.cuh"
#include "chorus/cuda/kernels/tensor_iter.cuh"

namespace chorus::cuda {

namespace {

// The parameter pointer of dtype G, or null for an undefined tensor.
template <typename G>
const G* param_ptr(const Tensor& t) {
  return t.defined() ? t.data<G>() : nullptr;
}

// Launches kern<T, V> with the widest V (16 bytes) that divides the rows and
// the pointers' alignment, else V = 1.
template <typename T, typename F>
void with_row_vector(int64_t s, std::initializer_list<const void*> ptrs, F&& f) {
  constexpr int kV = 16 / sizeof(T);
  bool vec = s % kV == 0;
  for (const void* p : ptrs) vec = vec && reinterpret_cast<uintptr_t>(p) % 16 == 0;
  if (vec) {
    f.template operator()<kV>();
  } else {
    f.template operator()<1>();
  }
}

// V elements per 16-byte access of x, y, dy and dx (a row of 768 bf16 is 96
// vectors: three per lane of its warp); the parameters are read element by
// element (the same few KB for every row: from L1).
template <typename T, typename G, int V>
__global__ void layer_norm_forward_kernel(const T* x, const G* gamma, const G* beta, float eps, T* y, float* mean,
                                          float* rstd, int64_t rows, int64_t cols) {
  const int64_t row = row_index();
  if (row >= rows) return;
  const int64_t nv = cols / V;
  const Vec<T, V>* xr = reinterpret_cast<const Vec<T, V>*>(x + row * cols);
  SumV s{0.0f};
  for (int64_t c = threadIdx.x; c < nv; c += blockDim.x) {
    const Vec<T, V> v = xr[c];
#pragma unroll
    for (int j = 0; j < V; ++j) s.s += to_acc(v.v[j]);
  }
  s = row_allreduce(s);
  const float m = s.s / static_cast<float>(cols);
  SumV var{0.0f};  // the variance of centred values (a second read, from cache)
  for (int64_t c = threadIdx.x; c < nv; c += blockDim.x) {
    const Vec<T, V> v = xr[c];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float d = to_acc(v.v[j]) - m;
      var.s += d * d;
    }
  }
  var = row_allreduce(var);
  const float rs = rsqrtf(var.s / static_cast<float>(cols) + eps);
  Vec<T, V>* yr = reinterpret_cast<Vec<T, V>*>(y + row * cols);
  for (int64_t c = threadIdx.x; c < nv; c += blockDim.x) {
    const Vec<T, V> v = xr[c];
    Vec<T, V> out;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int64_t col = c * V + j;
      const float g = gamma ? to_acc(gamma[col]) : 1.0f, b = beta ? to_acc(beta[col]) : 0.0f;
      out.v[j] = convert<T>((to_acc(v.v[j]) - m) * rs * g + b);
    }
    yr[c] = out;
  }
  if (threadIdx.x == 0) {
    mean[row] = m;
    rstd[row] = rs;
  }
}

// Note [Residual add beside layer norm] (ops/transformer.h): sum = x + r and
// the layer norm of sum in one kernel. Each thread writes its elements of the
// sum in the first pass and reads back the same elements (its own writes,
// from cache) in the next two, so the norm sees the sum rounded to T as a
// separate add would store it.
template <typename T, typename G, int V>
__global__ void add_layer_norm_forward_kernel(const T* x, const T* r, const G* gamma, const G* beta, float eps,
                                              T* sum, T* y, float* mean, float* rstd, int64_t rows, int64_t cols) {
  const int64_t row = row_index();
  if (row >= rows) return;
  const int64_t nv = cols / V;
  const Vec<T, V>* xr = reinterpret_cast<const Vec<T, V>*>(x + row * cols);
  const Vec<T, V>* rr = reinterpret_cast<const Vec<T, V>*>(r + row * cols);
  Vec<T, V>* sr = reinterpret_cast<Vec<T, V>*>(sum + row * cols);
  SumV s{0.0f};
  for (int64_t c = threadIdx.x; c < nv; c += blockDim.x) {
    const Vec<T, V> a = xr[c], b = rr[c];
    Vec<T, V> out;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      out.v[j] = convert<T>(to_acc(a.v[j]) + to_acc(b.v[j]));
      s.s += to_acc(out.v[j]);
    }
    sr[c] = out;
  }
  s = row_allreduce(s);
  const float m = s.s / static_cast<float>(cols);
  SumV var{0.0f};
  for (int64_t c = threadIdx.x; c < nv; c += blockDim.x) {
    const Vec<T, V> v = sr[c];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float d = to_acc(v.v[j]) - m;
      var.s += d * d;
    }
  }
  var = row_allreduce(var);
  const float rs = rsqrtf(var.s / static_cast<float>(cols) + eps);
  Vec<T, V>* yr = reinterpret_cast<Vec<T, V>*>(y + row * cols);
  for (int64_t c = threadIdx.x; c < nv; c += blockDim.x) {
    const Vec<T, V> v = sr[c];
    Vec<T, V> out;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int64_t col = c * V + j;
      const float g = gamma ? to_acc(gamma[col]) : 1.0f, b = beta ? to_acc(beta[col]) : 0.0f;
      out.v[j] = convert<T>((to_acc(v.v[j]) - m) * rs * g + b);
    }
    yr[c] = out;
  }
  if (threadIdx.x == 0) {
    mean[row] = m;
    rstd[row] = rs;
  }
}

// Two sums of a row at once.
struct SumPairV {
  float a, b;
  __device__ static SumPairV merge(SumPairV p, SumPairV q) { return {p.a + q.a, p.b + q.b}; }
  __device__ SumPairV shfl(int mask) const { return {shfl_xor(a, mask), shfl_xor(b, mask)}; }
};

// dx = rs * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) + dres, dxhat =
// dy * gamma; dres (the residual stream's gradient) may be null.
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
  for (int64_t c = threadIdx.x; c < nv; c += blockDim.x) {
    const Vec<T, V> d = dyr[c], v = xr[c];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float g = to_acc(d.v[j]) * (gamma ? to_acc(gamma[c * V + j]) : 1.0f);
      s.a += g;
      s.b += g * (to_acc(v.v[j]) - m) * rs;
    }
  }
  s = row_allreduce(s);
  const float inv = 1.0f / static_cast<float>(cols);
  Vec<T, V>* dxr = reinterpret_cast<Vec<T, V>*>(dx + row * cols);
  const Vec<T, V>* drr = reinterpret_cast<const Vec<T, V>*>(dres ? dres + row * cols : nullptr);
  for (int64_t c = threadIdx.x; c < nv; c += blockDim.x) {
    const Vec<T, V> d = dyr[c], v = xr[c];
    Vec<T, V> out;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float g = to_acc(d.v[j]) * (gamma ? to_acc(gamma[c * V + j]) : 1.0f);
      const float xhat = (to_acc(v.v[j]) - m) * rs;
      out.v[j] = convert<T>(rs * (g - s.a * inv - xhat * s.b * inv));
    }
    if (drr) {
      // Rounded once to T before the add, as a separate add of dx and dres
      // would see them: the fused op equals the composition.
      const Vec<T, V> e = drr[c];
#pragma unroll
      for (int j = 0; j < V; ++j) out.v[j] = convert<T>(to_acc(out.v[j]) + to_acc(e.v[j]));
    }
    dxr[c] = out;
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
constexpr int kFusedColsPerThread = 32;
constexpr int64_t kFusedMaxCols = int64_t{kFusedColsPerThread} * kBlockThreads;  // 8192

// dx as layer_norm_dx_kernel, plus this block's dgamma and dbeta partials
// (Note [Layer norm's backward in one pass]): partial[blockIdx.x * cols + c]
// and partial[(gridDim.x + blockIdx.x) * cols + c]. Launched with blockDim
// (32, kRowsPerBlock) and 2 * kRowsPerBlock * 32 * V floats of dynamic shared
// memory, or (R, 1) with R * kFusedColsPerThread >= cols and none.
template <typename T, typename G, int V>
__global__ void __launch_bounds__(kBlockThreads)
    layer_norm_backward_fused_kernel(const T* dy, const T* x, const G* gamma, const float* mean, const float* rstd,
                                     const T* dres, T* dx, float* partial, int64_t rows, int64_t cols) {
  constexpr int K = kFusedColsPerThread / V;  // vectors of a row this thread owns: threadIdx.x + k * blockDim.x
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
    const float m = mean[row], rs = rstd[row];
    SumPairV s{0.0f, 0.0f};
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t c = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (c < nv) {
        const Vec<T, V> d = dyr[c], v = xr[c];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float g = to_acc(d.v[j]) * (gamma ? to_acc(gamma[c * V + j]) : 1.0f);
          s.a += g;
          s.b += g * (to_acc(v.v[j]) - m) * rs;
        }
      }
    }
    s = row_allreduce(s);
    Vec<T, V>* dxr = reinterpret_cast<Vec<T, V>*>(dx + row * cols);
    const Vec<T, V>* drr = reinterpret_cast<const Vec<T, V>*>(dres ? dres + row * cols : nullptr);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t c = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (c < nv) {
        const Vec<T, V> d = dyr[c], v = xr[c];
        Vec<T, V> out;
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float dj = to_acc(d.v[j]);
          const float g = dj * (gamma ? to_acc(gamma[c * V + j]) : 1.0f);
          const float xhat = (to_acc(v.v[j]) - m) * rs;
          out.v[j] = convert<T>(rs * (g - s.a * inv - xhat * s.b * inv));
          pg[k][j] += dj * xhat;
          pb[k][j] += dj;
        }
        if (drr) {
          // Rounded once to T before the add, as in layer_norm_dx_kernel.
          const Vec<T, V> e = drr[c];
#pragma unroll
          for (int j = 0; j < V; ++j) out.v[j] = convert<T>(to_acc(out.v[j]) + to_acc(e.v[j]));
        }
        dxr[c] = out;
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

// One row of the fused classifier: loss = lse - x[t], dlogits = softmax - onehot
// over the first `valid` columns, 0 past them and on ignored rows.
// V elements per 16-byte access (a row of 50304 bf16 logits is 6288
// vectors): two reads of the row (the second mostly from L2) and one write.
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
  const Vec<T, V>* xr = reinterpret_cast<const Vec<T, V>*>(logits + row * cols);
  Vec<T, V>* dr = reinterpret_cast<Vec<T, V>*>(dlogits + row * cols);
  Vec<T, V> zero;
#pragma unroll
  for (int j = 0; j < V; ++j) zero.v[j] = convert<T>(0.0f);
  if (tg == ignore_index) {
    for (int64_t c = threadIdx.x; c < nv; c += blockDim.x) dr[c] = zero;
    if (threadIdx.x == 0) losses[row] = L(0);
    return;
  }
  // Note [The classifier's exponentials]: the row's max and sum of
  // exp(x - max) a 16-byte vector at a time -- the sum rescaled once per
  // vector whose max is new, not per element -- with the hardware's exp2
  // (__expf: ex2.approx of x log2 e, ~2 ulp, ~1e-6 relative at the
  // arguments a softmax sees) instead of expf's longer accurate sequence. Both
  // passes over the row were bound by the exponentials, not by the memory
  // (llm.c builds its classifier with --use_fast_math for the same reason).
  // A NaN logit makes the sum NaN (the row's loss NaN, as in PyTorch).
  MaxSumV ms{-INFINITY, 0.0f};
  for (int64_t c = valid_v - 1 - threadIdx.x; c >= 0; c -= blockDim.x) {
    const Vec<T, V> v = xr[c];
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
      continue;
    }
    if (vm > ms.m) {
      ms.s = ms.m == -INFINITY ? 0.0f : ms.s * __expf(ms.m - vm);
      ms.m = vm;
    }
#pragma unroll
    for (int j = 0; j < V; ++j) ms.s += __expf(x[j] - ms.m);
  }
  ms = row_allreduce(ms);
  const float log_sum = logf(ms.s);
  // The target's logit is read before any thread overwrites the row (dlogits may alias logits).
  const float x_t = (tg >= 0 && tg < valid) ? to_acc(logits[row * cols + tg]) : NAN;
  __syncwarp();
  if (blockDim.x > 32) __syncthreads();
  for (int64_t c = threadIdx.x; c < nv; c += blockDim.x) {
    if (c >= valid_v) {
      store_streaming(dr + c, zero);
      continue;
    }
    const Vec<T, V> v = xr[c];
    Vec<T, V> out;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int64_t col = c * V + j;
      const float g =
          col < valid ? (__expf((to_acc(v.v[j]) - ms.m) - log_sum) - (col == tg ? 1.0f : 0.0f)) * scale : 0.0f;
      out.v[j] = convert<T>(g);
    }
    store_streaming(dr + c, out);
  }
  // An out-of-range target gives a NaN loss rather than a read out of bounds.
  if (threadIdx.x == 0) losses[row] = L(-((x_t - ms.m) - log_sum));
}

int64_t rows_of(const Tensor& t) { return t.size(-1) ? t.numel() / t.size(-1) : 0; }

void check_cuda_contiguous(const Tensor& t, const char* op, const char* arg) {
  CHORUS_CHECK(t.device().is_cuda() && t.is_contiguous(), op, ": ", arg, " must be a contiguous CUDA tensor, got ",
               t.describe());
}

// Runs f.template operator()<G>() with G the element type of the layer norm's
// parameters: x's own, or float for float32 master weights.
template <typename T, typename F>
void with_param_type(const Tensor& gamma, const Tensor& beta, DType x_dtype, const char* op, F&& f) {
  DType g = gamma.defined() ? gamma.dtype() : beta.defined() ? beta.dtype() : x_dtype;
  CHORUS_CHECK((!gamma.defined() || gamma.dtype() == g) && (!beta.defined() || beta.dtype() == g), op,
               ": gamma and beta must share a dtype");
  if (g == kFloat32) return f.template operator()<float>();
  CHORUS_CHECK(g == x_dtype, op, ": gamma must be float32 or x's dtype ", dtype_name(x_dtype), ", got ",
               dtype_name(g));
  f.template operator()<T>();
}

}  // namespace

void layer_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps, const Tensor& y,
                        const Tensor& mean, const Tensor& rstd) {
  const char* op = "layer_norm_forward";
  check_cuda_contiguous(x, op, "x");
  check_cuda_contiguous(y, op, "y");
  CHORUS_CHECK(mean.dtype() == kFloat32 && rstd.dtype() == kFloat32, op, ": mean and rstd must be float32");
  const int64_t rows = rows_of(x), cols = x.size(-1);
  if (rows == 0) return;
  const int dev = x.device().index;
  CudaDeviceGuard guard(dev);
  const RowLaunch l = row_launch(rows, cols);
  dispatch_float(x.dtype(), op, [&]<typename T>() {
    with_param_type<T>(gamma, beta, x.dtype(), op, [&]<typename G>() {
      with_row_vector<T>(cols, {x.raw_data(), y.raw_data()}, [&]<int V>() {
        layer_norm_forward_kernel<T, G, V><<<l.grid, l.block, 0, current_stream(dev)>>>(
            x.data<T>(), param_ptr<G>(gamma), param_ptr<G>(beta), static_cast<float>(eps), y.data<T>(),
            mean.data<float>(), rstd.data<float>(), rows, cols);
      });
    });
  });
  CHORUS_CUDA_LAUNCH_CHECK();
}

void add_layer_norm_forward(const Tensor& x, const Tensor& r, const Tensor& gamma, const Tensor& beta, double eps,
                            const Tensor& sum, const Tensor& y, const Tensor& mean, const Tensor& rstd) {
  const char* op = "add_layer_norm_forward";
  check_cuda_contiguous(x, op, "x");
  check_cuda_contiguous(r, op, "r");
  check_cuda_contiguous(sum, op, "sum");
  check_cuda_contiguous(y, op, "y");
  CHORUS_CHECK(r.dtype() == x.dtype() && sum.dtype() == x.dtype() && y.dtype() == x.dtype() &&
                   r.sizes() == x.sizes() && sum.sizes() == x.sizes() && y.sizes() == x.sizes(),
               op, ": x, r, sum and y must share a shape and dtype");
  CHORUS_CHECK(mean.dtype() == kFloat32 && rstd.dtype() == kFloat32, op, ": mean and rstd must be float32");
  const int64_t rows = rows_of(x), cols = x.size(-1);
  if (rows == 0) return;
  const int dev = x.device().index;
  CudaDeviceGuard guard(dev);
  const RowLaunch l = row_launch(rows, cols);
  dispatch_float(x.dtype(), op, [&]<typename T>() {
    with_param_type<T>(gamma, beta, x.dtype(), op, [&]<typename G>() {
      with_row_vector<T>(cols, {x.raw_data(), r.raw_data(), sum.raw_data(), y.raw_data()}, [&]<int V>() {
        add_layer_norm_forward_kernel<T, G, V><<<l.grid, l.block, 0, current_stream(dev)>>>(
            x.data<T>(), r.data<T>(), param_ptr<G>(gamma), param_ptr<G>(beta), static_cast<float>(eps),
            sum.data<T>(), y.data<T>(), mean.data<float>(), rstd.data<float>(), rows, cols);
      });
    });
  });
  CHORUS_CUDA_LAUNCH_CHECK();
}

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
      with_row_vector<T>(cols, {dy.raw_data(), x.raw_data(), dx.raw_data(), dr}, [&]<int V>() {
        if (fused) {
          // Note [Layer norm's backward in one pass]: row_launch's layout, R
          // threads a long row (whole warps, enough that each owns at most
          // kFusedColsPerThread columns), as many blocks as fit at once.
          constexpr int K = kFusedColsPerThread / V;
          const int64_t nv = cols / V;
          const bool warp_rows = cols <= kWarpCols;
          const dim3 block = warp_rows ? dim3(32, kRowsPerBlock)
                                       : dim3(static_cast<unsigned>(((nv + K - 1) / K + 31) / 32 * 32), 1);
          const size_t smem = warp_rows ? 2 * kRowsPerBlock * 32 * V * sizeof(float) : 0;
          auto kernel = layer_norm_backward_fused_kernel<T, G, V>;
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
  // exponentials (session 40: gpt2 499.5k against 506.2k tok/s, one H200).
  const RowLaunch l = row_launch(rows, cols);
  dispatch_float(logits.dtype(), op, [&]<typename T>() {
    with_row_vector<T>(cols, {logits.raw_data(), dlogits.raw_data()}, [&]<int V>() {
      cross_entropy_fused_kernel<T, float, V><<<l.grid, l.block, 0, current_stream(dev)>>>(
          logits.data<T>(), target.data<int64_t>(), rows, cols, valid_cols, ignore_index, losses.data<float>(),
          dlogits.data<T>(), grad_scale.defined() ? grad_scale.data<float>() : nullptr);
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
