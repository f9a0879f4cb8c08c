// Channels-last batch norm kernels (Note [NHWC batch norm] in batch_norm_nhwc.h).
#include "chorus/cuda/conv/batch_norm_nhwc.h"

#include <algorithm>
#include <cstdint>

#include "chorus/cuda/runtime/context.h"
#include "chorus/cuda/kernels/dtype_dispatch.cuh"
#include "chorus/cuda/kernels/kernels.h"

namespace chorus::cuda {

namespace {

// Note [NHWC column reductions]
// The statistics and the gradient sums are per-channel sums over the M rows
// of the [M, C] matrix. Each thread reads kVec consecutive channels of a row
// as one 16-byte load (8 bf16), a block is tx column threads (the whole row
// when it fits in 256) by ty rows, and there are about two blocks per SM,
// each taking every (blocks x ty)-th row from its own (a stride of rows, as
// the elementwise passes: all SMs read one moving window of memory).
// A block's rows are summed by a tree in shared memory, laid out channel-major
// (sh[j][thread]) so a warp's stores and loads fall in 32 different banks;
// thread-major (sh[thread][j], 8 floats a thread) made every access an 8-way
// bank conflict, which the kernels at WRN-28-10's 16x16x320 and 8x8x640 paid
// for (scripts/probes/bn_reduce_probe.cu; benchmarks journal, session 23). The blocks' partials
// are summed in a finalize kernel where 32 lanes per channel read them and a
// tree sums the lanes (Note [Statistics by a common shift]). The first
// version (one bf16 per thread, a Welford update with a division per element,
// one thread merging a block's rows, one thread per channel walking every
// partial in a dependent chain of loads) spent most of its time in that last
// chain, more as the partials grew (benchmarks journal, session 8).
constexpr int kBlockThreads = 256;
constexpr int kMaxVec = 8;
// 16-byte loads a column-reduction thread issues before using any: with two
// 256-thread blocks per SM, one load in flight per thread is 8 KB per SM,
// short of what hides HBM's latency at full bandwidth. The statistics read one
// pack per row (8 rows at a time), the backward two (dy and x: 4 rows). (On
// an H100 8 rows made the statistics faster and the backward no faster; 4
// blocks per SM were slower for both: benchmarks journal, session 11.)
constexpr int kPartialLoads = 8;
// Finalize blocks: 32 channels by 32 lanes over the row blocks' partials
// (264 of them for 2 blocks per SM on 132 SMs), ~8 independent loads a lane.
constexpr int kFinalCols = 32;
constexpr int kFinalRows = 32;

struct Grid {
  dim3 grid, block;
};

// c % vec == 0. tx column threads (the row's C / vec packs, up to
// kBlockThreads) by ty rows per block, and row blocks for `per_sm` blocks on
// every SM (fewer when the rows run out); a block takes every
// (row blocks x ty)-th row.
Grid tile_grid(int64_t m, int64_t c, int vec, int device, int per_sm) {
  const int64_t col_threads = c / vec;
  const int tx = static_cast<int>(std::min<int64_t>(col_threads, kBlockThreads));
  const int ty = std::max(1, kBlockThreads / tx);
  const int64_t col_blocks = (col_threads + tx - 1) / tx;
  const int64_t target = int64_t{per_sm} * device_properties(device).multiProcessorCount;
  int64_t row_blocks = std::max<int64_t>(1, target / col_blocks);
  row_blocks = std::min<int64_t>(row_blocks, std::max<int64_t>(1, (m + ty - 1) / ty));
  row_blocks = std::min<int64_t>(row_blocks, 65535);
  return {dim3(static_cast<unsigned>(col_blocks), static_cast<unsigned>(row_blocks)),
          dim3(static_cast<unsigned>(tx), static_cast<unsigned>(ty))};
}

// The column reductions: about two blocks per SM, each thread left a few
// rows: many 16-byte loads in flight is what makes them run at memory speed.
// (1, 3, 4 and 6 blocks per SM were all slower for WRN-28-10 and WRN-16-4 bf16
// on an H200, 4 again on an H100 with the loads in flight: benchmarks
// journal, sessions 10 and 11. Once the tree's bank conflicts were gone, a
// probe of the kernels alone favoured 4 per SM for the backward's sums at
// 32x32x160 and 16x16x320 and 1 for the statistics at 8x8x640; in the graphed
// WRN-28-10 bf16 step on an H100 that grid was slower, so 2 stays: session 23.)
Grid column_grid(int64_t m, int64_t c, int vec, int device) { return tile_grid(m, c, vec, device, 2); }

// The largest power of two below n (0 for n <= 1): the first stride of a
// tree reduction over n lanes.
__device__ __forceinline__ unsigned tree_top(unsigned n) {
  unsigned h = 1;
  while (h * 2 < n) h *= 2;
  return n > 1 ? h : 0;
}

// A run of kVec elements moved as one aligned load or store.
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

// kVec per-channel float coefficients from col0 (a multiple of kVec; the
// arrays are [C] slices of one allocation, C % kVec == 0) in one or two loads.
template <int kVec>
__device__ __forceinline__ Pack<float, kVec> coefficients(const float* __restrict__ p, int64_t col0) {
  return *reinterpret_cast<const Pack<float, kVec>*>(p + col0);
}

// The affine coefficients y = x * s + t of a channel, and the pre-ReLU value
// of an element: one definition for the forward and the backward, so the
// backward's ReLU mask (Note [ReLU mask from x]) is the forward's bit for bit.
__device__ __forceinline__ void affine_coefficients(float gamma, float beta, float mean, float invstd, float& s,
                                                    float& t) {
  s = invstd * gamma;
  t = beta - mean * s;
}
__device__ __forceinline__ float affine_value(float x, float s, float t) { return x * s + t; }

// Note [Statistics by a common shift]
// The statistics are sums of d = x - x[0, c] (the first row's value of the
// channel, which every thread reads): sum d and sum d^2 per channel, so the
// variance sum d^2 / M - (sum d / M)^2 has no cancellation for a mean large
// against the spread (the shift is one of the channel's own values), and
// every merge (rows of a block, row blocks) is a plain sum. The first version
// merged (count, mean, m2) Welford triples, a division per merge: its
// finalize kernel, a chain of dependent merges, took nearly as long as the
// pass over the data at the small layers (Nsight Compute, H100; benchmarks
// journal, session 11).

// The block's rows of a and b (kVec channels per thread, blockDim.x column
// threads by blockDim.y rows) summed by a tree in shared memory; row 0's
// threads write the block's sums to pa[blockIdx.y, c], pb[blockIdx.y, c].
template <int kVec>
__device__ __forceinline__ void write_block_column_sums(const float (&a)[kVec], const float (&b)[kVec], bool active,
                                                        int64_t c, int64_t col0, float* __restrict__ pa,
                                                        float* __restrict__ pb) {
  __shared__ float sh_a[kBlockThreads * kMaxVec], sh_b[kBlockThreads * kMaxVec];
  const int t = threadIdx.y * blockDim.x + threadIdx.x;
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    sh_a[j * kBlockThreads + t] = a[j];
    sh_b[j * kBlockThreads + t] = b[j];
  }
  // log2(ty) rounds, not ty additions in one thread.
  for (unsigned half = tree_top(blockDim.y); half > 0; half /= 2) {
    __syncthreads();
    if (threadIdx.y < half && threadIdx.y + half < blockDim.y) {
      const int u = t + half * blockDim.x;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        sh_a[j * kBlockThreads + t] += sh_a[j * kBlockThreads + u];
        sh_b[j * kBlockThreads + t] += sh_b[j * kBlockThreads + u];
      }
    }
  }
  if (threadIdx.y != 0 || !active) return;
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    pa[int64_t{blockIdx.y} * c + col0 + j] = sh_a[j * kBlockThreads + t];
    pb[int64_t{blockIdx.y} * c + col0 + j] = sh_b[j * kBlockThreads + t];
  }
}

// Per channel col (blockIdx.x * kFinalCols + threadIdx.x), the sums over the
// row blocks' partials pa[b, col], pb[b, col]: kFinalRows lanes each add every
// kFinalRows-th partial (independent loads, many in flight), then a tree.
// Valid in the threadIdx.y == 0 lanes.
__device__ __forceinline__ void sum_partials(const float* __restrict__ pa, const float* __restrict__ pb,
                                             int64_t blocks, int64_t c, int64_t col, float& a, float& b) {
  a = 0;
  b = 0;
  if (col < c) {
#pragma unroll 8
    for (int64_t i = threadIdx.y; i < blocks; i += kFinalRows) {
      a += pa[i * c + col];
      b += pb[i * c + col];
    }
  }
  __shared__ float sh[2][kFinalRows][kFinalCols];
  sh[0][threadIdx.y][threadIdx.x] = a;
  sh[1][threadIdx.y][threadIdx.x] = b;
  for (int half = kFinalRows / 2; half > 0; half /= 2) {
    __syncthreads();
    if (threadIdx.y < half) {
      a += sh[0][threadIdx.y + half][threadIdx.x];
      b += sh[1][threadIdx.y + half][threadIdx.x];
      sh[0][threadIdx.y][threadIdx.x] = a;
      sh[1][threadIdx.y][threadIdx.x] = b;
    }
  }
}

// The pack a + b, rounded to T as a separate add would round it
// (Note [Residual add left to the batch norm]).
template <typename T, int kVec>
__device__ __forceinline__ Pack<T, kVec> sum_pack(const Pack<T, kVec>& a, const Pack<T, kVec>& b) {
  Pack<T, kVec> out;
#pragma unroll
  for (int j = 0; j < kVec; ++j) out.v[j] = convert<T>(to_acc(a.v[j]) + to_acc(b.v[j]));
  return out;
}

// partial[b, c] = (sum d, sum d^2) of column c over row block b, d = x - x[0, c]
// (Note [Statistics by a common shift]), kVec channels per thread. With kSum,
// x is a + b, written to x as it is summed (Note [Residual add left to the
// batch norm]): two loads a row, so half the rows in flight.
template <typename T, int kVec, bool kSum>
__global__ void __launch_bounds__(kBlockThreads)
    stats_partial_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ x, int64_t m, int64_t c,
                         float* __restrict__ ps1, float* __restrict__ ps2) {
  const int64_t col0 = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) * kVec;
  float k[kVec], s1[kVec], s2[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) k[j] = s1[j] = s2[j] = 0.0f;
  const bool active = col0 < c;
  if (active) {
    auto row_pack = [&](int64_t r) {
      const Pack<T, kVec> pa = *reinterpret_cast<const Pack<T, kVec>*>(a + r * c + col0);
      if constexpr (!kSum) return pa;
      else return sum_pack(pa, *reinterpret_cast<const Pack<T, kVec>*>(b + r * c + col0));
    };
    const Pack<T, kVec> first = row_pack(0);
#pragma unroll
    for (int j = 0; j < kVec; ++j) k[j] = to_acc(first.v[j]);
    auto add = [&](const Pack<T, kVec>& in) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float d = static_cast<float>(to_acc(in.v[j])) - k[j];
        s1[j] += d;
        s2[j] = fmaf(d, d, s2[j]);
      }
    };
    constexpr int kPartialRows = kSum ? kPartialLoads / 2 : kPartialLoads;
    const int64_t step = int64_t{gridDim.y} * blockDim.y, r1 = m;  // Note [NHWC column reductions]
    int64_t r = int64_t{blockIdx.y} * blockDim.y + threadIdx.y;
    for (; r + (kPartialRows - 1) * step < r1; r += kPartialRows * step) {
      Pack<T, kVec> in[kPartialRows], in_b[kSum ? kPartialRows : 1];
#pragma unroll
      for (int u = 0; u < kPartialRows; ++u) {
        in[u] = *reinterpret_cast<const Pack<T, kVec>*>(a + (r + u * step) * c + col0);
        if constexpr (kSum) in_b[u] = *reinterpret_cast<const Pack<T, kVec>*>(b + (r + u * step) * c + col0);
      }
#pragma unroll
      for (int u = 0; u < kPartialRows; ++u) {
        if constexpr (kSum) {
          in[u] = sum_pack(in[u], in_b[u]);
          *reinterpret_cast<Pack<T, kVec>*>(x + (r + u * step) * c + col0) = in[u];
        }
        add(in[u]);
      }
    }
    for (; r < r1; r += step) {
      const Pack<T, kVec> in = row_pack(r);
      if constexpr (kSum) *reinterpret_cast<Pack<T, kVec>*>(x + r * c + col0) = in;
      add(in);
    }
  }
  write_block_column_sums<kVec>(s1, s2, active, c, col0, ps1, ps2);
}

// Per channel: combine the partials into the batch statistics, save them,
// update the running statistics, and write the affine coefficients
// y = x * scale + shift.
template <typename T>
__global__ void stats_finalize_kernel(const T* __restrict__ x, const float* __restrict__ ps1,
                                      const float* __restrict__ ps2, int64_t blocks, int64_t m, int64_t c,
                                      const float* __restrict__ gamma, const float* __restrict__ beta,
                                      float* running_mean, float* running_var, float momentum, float eps,
                                      float* __restrict__ save_mean, float* __restrict__ save_invstd,
                                      float* __restrict__ scale, float* __restrict__ shift,
                                      int64_t* __restrict__ num_batches_tracked) {
  const int64_t col = int64_t{blockIdx.x} * kFinalCols + threadIdx.x;
  // The module's batch counter, here rather than in a launch of its own (25
  // launches a step in WRN-28-10).
  if (num_batches_tracked && blockIdx.x == 0 && threadIdx.x == 0 && threadIdx.y == 0) ++*num_batches_tracked;
  // The per-channel operands are loaded before the partials are summed, so
  // their latency overlaps the sum's instead of following it.
  const bool writer = threadIdx.y == 0 && col < c;
  float x0 = 0, g = 0, b = 0, rm = 0, rv = 0;
  if (writer) {
    x0 = static_cast<float>(to_acc(x[col]));
    g = gamma[col];
    b = beta[col];
    if (running_mean) {
      rm = running_mean[col];
      rv = running_var[col];
    }
  }
  float s1, s2;
  sum_partials(ps1, ps2, blocks, c, col, s1, s2);
  if (!writer) return;
  const float n = static_cast<float>(m);
  const float d = s1 / n;
  const float var = fmaxf(0.0f, s2 / n - d * d);  // biased: what normalises
  const float mean = x0 + d;
  const float invstd = rsqrtf(var + eps);
  save_mean[col] = mean;
  save_invstd[col] = invstd;
  if (running_mean) {
    const float unbiased = m > 1 ? var * n / (n - 1) : var;
    running_mean[col] = (1 - momentum) * rm + momentum * mean;
    running_var[col] = (1 - momentum) * rv + momentum * unbiased;
  }
  float s, t;
  affine_coefficients(g, b, mean, invstd, s, t);
  scale[col] = s;
  shift[col] = t;
}

// Evaluation: coefficients from the running statistics.
__global__ void eval_coefficients_kernel(int64_t c, const float* __restrict__ gamma,
                                         const float* __restrict__ beta,
                                         const float* __restrict__ running_mean,
                                         const float* __restrict__ running_var, float eps,
                                         float* __restrict__ scale, float* __restrict__ shift) {
  const int64_t col = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (col >= c) return;
  const float s = rsqrtf(running_var[col] + eps) * gamma[col];
  scale[col] = s;
  shift[col] = beta[col] - running_mean[col] * s;
}

// Note [Elementwise passes by column]: the normalisation and the backward's
// dx pass walk the [M, C] matrix with each thread on one fixed pack of kVec
// channels and a stride of rows, so a thread loads its channels'
// coefficients once into registers, and kRows rows' loads are issued before
// any is used. The first version (a flat grid-stride loop over packs) paid a
// 64-bit modulo per pack for its channel and reloaded two (forward) or five
// (backward) 32-byte coefficient packs for every 16 bytes of data: well above
// the memory-bound time for WRN-28-10 (benchmarks journal, session 11).
constexpr int kRows = 4;

// The elementwise passes: enough blocks to fill every SM (8 of 256 threads).
Grid row_grid(int64_t m, int64_t c, int vec, int device) { return tile_grid(m, c, vec, device, 8); }

template <typename T, int kVec>
__device__ __forceinline__ Pack<T, kVec> load_pack(const T* __restrict__ p, int64_t row, int64_t c, int64_t col0) {
  return *reinterpret_cast<const Pack<T, kVec>*>(p + row * c + col0);
}
template <typename T, int kVec>
__device__ __forceinline__ void store_pack(T* __restrict__ p, int64_t row, int64_t c, int64_t col0,
                                           const Pack<T, kVec>& v) {
  *reinterpret_cast<Pack<T, kVec>*>(p + row * c + col0) = v;
}

template <typename T, int kVec, bool kRelu>
__device__ __forceinline__ Pack<T, kVec> affine_pack(const Pack<T, kVec>& in, const Pack<float, kVec>& sc,
                                                     const Pack<float, kVec>& sh) {
  Pack<T, kVec> out;
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    const float v = affine_value(to_acc(in.v[i]), sc.v[i], sh.v[i]);
    out.v[i] = convert<T>(kRelu && !(v > 0.0f) ? 0.0f : v);  // as UnaryOp::Relu
  }
  return out;
}

// y = x * scale[c] + shift[c] (then max(0, y) with kRelu) over the [M, C]
// matrix (Note [Elementwise passes by column]; C % kVec == 0 and 16-byte
// aligned pointers when kVec > 1).
template <typename T, int kVec, bool kRelu>
__global__ void __launch_bounds__(kBlockThreads)
    affine_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t m, int64_t c, const float* __restrict__ scale,
                  const float* __restrict__ shift) {
  const int64_t col0 = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) * kVec;
  if (col0 >= c) return;
  const Pack<float, kVec> sc = coefficients<kVec>(scale, col0), sh = coefficients<kVec>(shift, col0);
  const int64_t stride = int64_t{gridDim.y} * blockDim.y;
  int64_t r = int64_t{blockIdx.y} * blockDim.y + threadIdx.y;
  for (; r + (kRows - 1) * stride < m; r += kRows * stride) {
    Pack<T, kVec> in[kRows];
#pragma unroll
    for (int u = 0; u < kRows; ++u) in[u] = load_pack<T, kVec>(x, r + u * stride, c, col0);
#pragma unroll
    for (int u = 0; u < kRows; ++u) store_pack<T, kVec>(y, r + u * stride, c, col0, affine_pack<T, kVec, kRelu>(in[u], sc, sh));
  }
  for (; r < m; r += stride)
    store_pack<T, kVec>(y, r, c, col0, affine_pack<T, kVec, kRelu>(load_pack<T, kVec>(x, r, c, col0), sc, sh));
}

// Note [ReLU mask from x]: the fused ReLU's backward needs y > 0. Reading
// the saved output y for it cost a third of the backward's reads (dy, x, y);
// instead the mask is recomputed from x and the forward's coefficients,
// affine_value(x, s, t) > 0, the very float the forward rounded into y. (A
// positive value below bfloat16's smallest subnormal rounds y to 0 but counts
// here: its gradient passes, as a float32 forward's would.)
//
// partial[b, c] = (sum dy, sum dy * (x - mean)) of column c over row block b,
// kVec channels per thread as in stats_partial_kernel. With relu (a fused
// ReLU after the batch norm), dy counts only where the forward's output was
// positive (Note [ReLU mask from x]); gamma and beta may be null then (1, 0).
template <typename T, int kVec>
__global__ void __launch_bounds__(kBlockThreads)
    backward_partial_kernel(const T* __restrict__ dy, const T* __restrict__ x, bool relu,
                            const float* __restrict__ gamma, const float* __restrict__ beta,
                            const float* __restrict__ mean, const float* __restrict__ invstd, int64_t m,
                            int64_t c, float* __restrict__ psum_dy,
                            float* __restrict__ psum_dy_xmu) {
  const int64_t col0 = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) * kVec;
  float s[kVec], sx[kVec], mu[kVec], cs[kVec], ct[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) s[j] = sx[j] = mu[j] = cs[j] = ct[j] = 0.0f;
  const bool active = col0 < c;
  if (active) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      mu[j] = mean[col0 + j];
      if (relu) affine_coefficients(gamma[col0 + j], beta[col0 + j], mu[j], invstd[col0 + j], cs[j], ct[j]);
    }
    auto add = [&](const Pack<T, kVec>& g, const Pack<T, kVec>& v) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float xj = static_cast<float>(to_acc(v.v[j]));
        const float gj =
            relu && !(affine_value(xj, cs[j], ct[j]) > 0.0f) ? 0.0f : static_cast<float>(to_acc(g.v[j]));
        s[j] += gj;
        sx[j] = fmaf(gj, xj - mu[j], sx[j]);
      }
    };
    constexpr int kPartialRows = kPartialLoads / 2;
    const int64_t step = int64_t{gridDim.y} * blockDim.y, r1 = m;  // Note [NHWC column reductions]
    int64_t r = int64_t{blockIdx.y} * blockDim.y + threadIdx.y;
    for (; r + (kPartialRows - 1) * step < r1; r += kPartialRows * step) {
      Pack<T, kVec> g[kPartialRows], v[kPartialRows];
#pragma unroll
      for (int u = 0; u < kPartialRows; ++u) {
        g[u] = *reinterpret_cast<const Pack<T, kVec>*>(dy + (r + u * step) * c + col0);
        v[u] = *reinterpret_cast<const Pack<T, kVec>*>(x + (r + u * step) * c + col0);
      }
#pragma unroll
      for (int u = 0; u < kPartialRows; ++u) add(g[u], v[u]);
    }
    for (; r < r1; r += step)
      add(*reinterpret_cast<const Pack<T, kVec>*>(dy + r * c + col0),
          *reinterpret_cast<const Pack<T, kVec>*>(x + r * c + col0));
  }
  write_block_column_sums<kVec>(s, sx, active, c, col0, psum_dy, psum_dy_xmu);
}

// Per channel: dgamma, dbeta and dx = a * dy + b * x + d.
__global__ void backward_finalize_kernel(const float* __restrict__ psum_dy,
                                         const float* __restrict__ psum_dy_xmu, int64_t blocks,
                                         int64_t m, int64_t c, const float* __restrict__ gamma,
                                         const float* __restrict__ mean,
                                         const float* __restrict__ invstd,
                                         float* __restrict__ dgamma, float* __restrict__ dbeta,
                                         float* __restrict__ ca, float* __restrict__ cb,
                                         float* __restrict__ cd, const float* __restrict__ beta,
                                         float* __restrict__ cs, float* __restrict__ ct) {
  const int64_t col = int64_t{blockIdx.x} * kFinalCols + threadIdx.x;
  const bool writer = threadIdx.y == 0 && col < c;
  float is = 0, mu = 0, gm = 0, bt = 0;  // loaded ahead of the sum, as in stats_finalize_kernel
  if (writer) {
    is = invstd[col];
    mu = mean[col];
    gm = gamma[col];
    if (cs) bt = beta[col];
  }
  float s, sx;
  sum_partials(psum_dy, psum_dy_xmu, blocks, c, col, s, sx);
  if (!writer) return;
  dgamma[col] = sx * is;
  dbeta[col] = s;
  // dx = gamma*is * (dy - s/M - (x - mu) * is^2 * sx/M)
  const float a = gm * is;
  const float k = sx * is * is / static_cast<float>(m);
  ca[col] = a;
  cb[col] = -a * k;
  cd[col] = a * (k * mu - s / static_cast<float>(m));
  if (cs) affine_coefficients(gm, bt, mu, is, cs[col], ct[col]);  // the ReLU's mask
}

// The coefficients of dx = a * dy' + b * x + d for one pack of channels,
// with the forward's ReLU (cs, ct: Note [ReLU mask from x]) when kRelu.
template <int kVec>
struct BackwardCoefficients {
  Pack<float, kVec> a, b, d, s, t;
};

template <typename T, int kVec, bool kRelu, bool kAdd>
__device__ __forceinline__ Pack<T, kVec> backward_pack(const Pack<T, kVec>& g, const Pack<T, kVec>& v,
                                                       const BackwardCoefficients<kVec>& k,
                                                       const Pack<T, kVec>& addend) {
  Pack<T, kVec> out;
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    const float xi = to_acc(v.v[i]);
    const float gi = kRelu && !(affine_value(xi, k.s.v[i], k.t.v[i]) > 0.0f) ? 0.0f : to_acc(g.v[i]);
    const float r = k.a.v[i] * gi + k.b.v[i] * xi + k.d.v[i];
    out.v[i] = convert<T>(kAdd ? r + to_acc(addend.v[i]) : r);
  }
  return out;
}

// dx = a * dy' + b * x + d (+ addend when given: the gradient already waiting
// for x, Note [Gradient addends] in autograd/node.h), dy' = dy masked by the
// forward's ReLU when kRelu (Note [Elementwise passes by column]).
// kAdd is a template parameter: a run-time test left the kernel without an
// addend slower (H100, WRN-28-10's shapes; benchmarks journal, session 12),
// the unused packs still taking registers.
template <typename T, int kVec, bool kRelu, bool kAdd>
__global__ void __launch_bounds__(kBlockThreads)
    backward_elementwise_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ addend,
                                T* __restrict__ dx, int64_t m,
                                int64_t c, const float* __restrict__ ca, const float* __restrict__ cb,
                                const float* __restrict__ cd, const float* __restrict__ cs,
                                const float* __restrict__ ct) {
  const int64_t col0 = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) * kVec;
  if (col0 >= c) return;
  BackwardCoefficients<kVec> k;
  k.a = coefficients<kVec>(ca, col0);
  k.b = coefficients<kVec>(cb, col0);
  k.d = coefficients<kVec>(cd, col0);
  if (kRelu) {
    k.s = coefficients<kVec>(cs, col0);
    k.t = coefficients<kVec>(ct, col0);
  }
  const int64_t stride = int64_t{gridDim.y} * blockDim.y;
  int64_t r = int64_t{blockIdx.y} * blockDim.y + threadIdx.y;
  for (; r + (kRows - 1) * stride < m; r += kRows * stride) {
    Pack<T, kVec> g[kRows], v[kRows], a[kAdd ? kRows : 1];
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      g[u] = load_pack<T, kVec>(dy, r + u * stride, c, col0);
      v[u] = load_pack<T, kVec>(x, r + u * stride, c, col0);
      if constexpr (kAdd) a[u] = load_pack<T, kVec>(addend, r + u * stride, c, col0);
    }
#pragma unroll
    for (int u = 0; u < kRows; ++u)
      store_pack<T, kVec>(dx, r + u * stride, c, col0,
                          backward_pack<T, kVec, kRelu, kAdd>(g[u], v[u], k, a[kAdd ? u : 0]));
  }
  for (; r < m; r += stride) {
    Pack<T, kVec> a;
    if constexpr (kAdd) a = load_pack<T, kVec>(addend, r, c, col0);
    store_pack<T, kVec>(dx, r, c, col0,
                        backward_pack<T, kVec, kRelu, kAdd>(load_pack<T, kVec>(dy, r, c, col0),
                                                            load_pack<T, kVec>(x, r, c, col0), k, a));
  }
}

Tensor scratch(int64_t n, Device d) { return detail::empty_tensor({n}, kFloat32, d); }

float* f32(const Tensor& t) { return t.defined() ? static_cast<float*>(t.raw_data()) : nullptr; }

// The widest pack (16 bytes at most) that divides C and suits every pointer.
template <typename T>
int pack_width(int64_t c, std::initializer_list<const void*> ptrs) {
  int vec = static_cast<int>(16 / sizeof(T));
  for (; vec > 1; vec /= 2) {
    if (c % vec != 0) continue;
    bool aligned = true;
    for (const void* p : ptrs) aligned = aligned && reinterpret_cast<uintptr_t>(p) % (sizeof(T) * vec) == 0;
    if (aligned) break;
  }
  return vec;
}

// Calls fn.template operator()<kVec>() for a width pack_width returned.
template <typename T, typename F>
void with_pack_width(int vec, F&& fn) {
  switch (vec) {
    case 8: if constexpr (16 / sizeof(T) >= 8) { fn.template operator()<8>(); break; } [[fallthrough]];
    case 4: if constexpr (16 / sizeof(T) >= 4) { fn.template operator()<4>(); break; } [[fallthrough]];
    case 2: fn.template operator()<2>(); break;
    default: fn.template operator()<1>(); break;
  }
}

template <typename T>
void launch_affine(const Tensor& x, const Tensor& y, int64_t c, const float* scale,
                   const float* shift, int device, bool relu) {
  const T* xp = static_cast<const T*>(x.raw_data());
  T* yp = static_cast<T*>(y.raw_data());
  const int64_t m = x.numel() / c;
  cudaStream_t stream = current_stream(device);
  const int vec = pack_width<T>(c, {xp, yp});
  const Grid g = row_grid(m, c, vec, device);
  with_pack_width<T>(vec, [&]<int kVec>() {
    if (relu) {
      affine_kernel<T, kVec, true><<<g.grid, g.block, 0, stream>>>(xp, yp, m, c, scale, shift);
    } else {
      affine_kernel<T, kVec, false><<<g.grid, g.block, 0, stream>>>(xp, yp, m, c, scale, shift);
    }
  });
  CHORUS_CUDA_LAUNCH_CHECK();
}

int64_t channels(const Tensor& x) { return x.size(1); }

unsigned final_blocks(int64_t c) { return static_cast<unsigned>((c + kFinalCols - 1) / kFinalCols); }

}  // namespace

namespace {

// The training forward over x, or over x = a + b written as the statistics
// are taken when `b` is defined (Note [Residual add left to the batch norm]).
void forward_train(const Tensor& a, const Tensor& b, const Tensor& x, const Tensor& gamma, const Tensor& beta,
                   const Tensor& running_mean, const Tensor& running_var, double momentum, double eps,
                   const Tensor& y, const Tensor& save_mean, const Tensor& save_invstd, bool relu,
                   const Tensor& num_batches_tracked) {
  const int device = x.device().index;
  const int64_t c = channels(x), m = x.numel() / c;
  cudaStream_t stream = current_stream(device);
  dispatch_float(x.dtype(), "batch_norm_forward", [&]<typename T>() {
    const T* ap = static_cast<const T*>(a.raw_data());
    const T* bp = b.defined() ? static_cast<const T*>(b.raw_data()) : nullptr;
    T* xp = static_cast<T*>(x.raw_data());
    const int vec = bp ? pack_width<T>(c, {ap, bp, xp}) : pack_width<T>(c, {xp});
    const Grid g = column_grid(m, c, vec, device);
    const int64_t blocks = g.grid.y;
    Tensor partial = scratch(2 * blocks * c, x.device()), coef = scratch(2 * c, x.device());
    float* ps1 = f32(partial);
    float* ps2 = ps1 + blocks * c;
    float* scale = f32(coef);
    float* shift = scale + c;
    with_pack_width<T>(vec, [&]<int kVec>() {
      if (bp) {
        stats_partial_kernel<T, kVec, true><<<g.grid, g.block, 0, stream>>>(ap, bp, xp, m, c, ps1, ps2);
      } else {
        stats_partial_kernel<T, kVec, false><<<g.grid, g.block, 0, stream>>>(xp, nullptr, nullptr, m, c, ps1, ps2);
      }
    });
    CHORUS_CUDA_LAUNCH_CHECK();
    stats_finalize_kernel<T><<<final_blocks(c), dim3(kFinalCols, kFinalRows), 0, stream>>>(
        xp, ps1, ps2, blocks, m, c, f32(gamma), f32(beta), f32(running_mean), f32(running_var),
        static_cast<float>(momentum), static_cast<float>(eps), f32(save_mean), f32(save_invstd),
        scale, shift,
        num_batches_tracked.defined() ? static_cast<int64_t*>(num_batches_tracked.raw_data()) : nullptr);
    CHORUS_CUDA_LAUNCH_CHECK();
    launch_affine<T>(x, y, c, scale, shift, device, relu);
  });
}

}  // namespace

void batch_norm_nhwc_forward_train(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                   const Tensor& running_mean, const Tensor& running_var,
                                   double momentum, double eps, const Tensor& y,
                                   const Tensor& save_mean, const Tensor& save_invstd, bool relu,
                                   const Tensor& num_batches_tracked) {
  forward_train(x, Tensor(), x, gamma, beta, running_mean, running_var, momentum, eps, y, save_mean, save_invstd,
                relu, num_batches_tracked);
}

void batch_norm_nhwc_forward_train_sum(const Tensor& a, const Tensor& b, const Tensor& x, const Tensor& gamma,
                                       const Tensor& beta, const Tensor& running_mean, const Tensor& running_var,
                                       double momentum, double eps, const Tensor& y, const Tensor& save_mean,
                                       const Tensor& save_invstd, bool relu, const Tensor& num_batches_tracked) {
  forward_train(a, b, x, gamma, beta, running_mean, running_var, momentum, eps, y, save_mean, save_invstd, relu,
                num_batches_tracked);
}

void batch_norm_nhwc_forward_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                  const Tensor& running_mean, const Tensor& running_var,
                                  double eps, const Tensor& y) {
  const int device = x.device().index;
  const int64_t c = channels(x);
  Tensor coef = scratch(2 * c, x.device());
  float* scale = f32(coef);
  float* shift = scale + c;
  eval_coefficients_kernel<<<static_cast<unsigned>((c + 127) / 128), 128, 0,
                             current_stream(device)>>>(c, f32(gamma), f32(beta),
                                                       f32(running_mean), f32(running_var),
                                                       static_cast<float>(eps), scale, shift);
  CHORUS_CUDA_LAUNCH_CHECK();
  dispatch_float(x.dtype(), "batch_norm_forward", [&]<typename T>() {
    launch_affine<T>(x, y, c, scale, shift, device, false);
  });
}

void batch_norm_nhwc_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                              const Tensor& save_mean, const Tensor& save_invstd,
                              const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta,
                              bool relu, const Tensor& beta, const Tensor& dx_addend) {
  const int device = x.device().index;
  const int64_t c = channels(x), m = x.numel() / c;
  cudaStream_t stream = current_stream(device);
  dispatch_float(x.dtype(), "batch_norm_backward", [&]<typename T>() {
    const T* dyp = static_cast<const T*>(dy.raw_data());
    const T* xp = static_cast<const T*>(x.raw_data());
    const T* ap = dx_addend.defined() ? static_cast<const T*>(dx_addend.raw_data()) : nullptr;
    T* dxp = static_cast<T*>(dx.raw_data());
    const int vec = ap ? pack_width<T>(c, {dyp, xp, dxp, ap}) : pack_width<T>(c, {dyp, xp, dxp});
    const Grid g = column_grid(m, c, vec, device);
    const int64_t blocks = g.grid.y;
    Tensor partial = scratch(2 * blocks * c, x.device()), coef = scratch((relu ? 5 : 3) * c, x.device());
    float* ps = f32(partial);
    float* psx = ps + blocks * c;
    float* ca = f32(coef);
    float* cb = ca + c;
    float* cd = cb + c;
    float* cs = relu ? cd + c : nullptr;
    float* ct = relu ? cs + c : nullptr;
    with_pack_width<T>(vec, [&]<int kVec>() {
      backward_partial_kernel<T, kVec><<<g.grid, g.block, 0, stream>>>(
          dyp, xp, relu, f32(gamma), f32(beta), f32(save_mean), f32(save_invstd), m, c, ps, psx);
    });
    CHORUS_CUDA_LAUNCH_CHECK();
    backward_finalize_kernel<<<final_blocks(c), dim3(kFinalCols, kFinalRows), 0, stream>>>(
        ps, psx, blocks, m, c, f32(gamma), f32(save_mean), f32(save_invstd), f32(dgamma),
        f32(dbeta), ca, cb, cd, f32(beta), cs, ct);
    CHORUS_CUDA_LAUNCH_CHECK();
    const Grid rg = row_grid(m, c, vec, device);
    with_pack_width<T>(vec, [&]<int kVec>() {
      auto launch = [&]<bool kRelu, bool kAdd>() {
        backward_elementwise_kernel<T, kVec, kRelu, kAdd>
            <<<rg.grid, rg.block, 0, stream>>>(dyp, xp, ap, dxp, m, c, ca, cb, cd, cs, ct);
      };
      if (relu) {
        if (ap) launch.template operator()<true, true>();
        else launch.template operator()<true, false>();
      } else {
        if (ap) launch.template operator()<false, true>();
        else launch.template operator()<false, false>();
      }
    });
    CHORUS_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace chorus::cuda
