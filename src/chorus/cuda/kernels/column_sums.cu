// Column sums of a [rows, cols] matrix -- a linear layer's bias gradient from
// its output's gradient -- alone, or with GELU's (tanh form) gradient made in
// the same pass (Note [Bias gradients as column sums]).
#include <algorithm>
#include <cstdint>

#include "chorus/cuda/kernels/column_sums.h"
#include "chorus/cuda/kernels/dtype_dispatch.cuh"
#include "chorus/cuda/kernels/kernels.h"
#include "chorus/cuda/kernels/tensor_iter.cuh"
#include "chorus/cuda/runtime/context.h"

namespace chorus::cuda {

namespace {

// Note [Bias gradients as column sums]: a linear layer's bias gradient is the
// column sums of its output's gradient dY [tokens, N]. cuBLASLt's BGRADB
// epilogue ran them, on an H200 (CUDA 13), as a kernel of its own after the
// weight gradient's product (globalKernelBgradAB: 48 of them, 1.27 ms a gpt2
// step, reading dY at about half the memory's bandwidth). Here:
//  - at a GPT MLP's hidden layer the pass that makes the gradient,
//    d = (dy w2) * gelu'(pre) -- the widest tensor of the block -- keeps the
//    column sums in registers as it writes d, so d is not read again
//    (Note [GELU's gradient with the bias gradient]);
//  - elsewhere one read-only pass sums dY's columns.
// Each thread owns V adjacent columns (one 16-byte vector; a warp reads 512
// contiguous bytes of a row) and walks rows with a stride, two rows in flight;
// the block's 8 row lanes are summed in shared memory in order, and a second
// small kernel adds the blocks' partial rows in a fixed order: no atomics,
// the same bits every run.
//
// Note [GELU's gradient with the bias gradient]: for 16-bit data tanh is the
// hardware's tanh.approx (~2^-11 relative, below bf16's 2^-9 rounding of d);
// float32 keeps tanhf. The sums are of d as stored.
constexpr int kColThreads = 32;  // threads across columns (one warp: coalesced rows)
constexpr int kRowThreads = 8;   // threads across rows
constexpr int kMaxRowBlocks = 256;

template <typename T>
__device__ __forceinline__ float gelu_tanh_slope(float y) {
  const float k = 0.7978845608028654f;
  const float u = k * (y + 0.044715f * y * y * y);
  float t;
  if constexpr (sizeof(T) == 2) {
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(u));
  } else {
    t = tanhf(u);
  }
  return 0.5f * (1.0f + t) + 0.5f * y * (1.0f - t * t) * k * (1.0f + 3.0f * 0.044715f * y * y);
}

// One row's vector: with Gelu, d = d * gelu'(pre) stored back; the sums take d.
template <typename T, int V, bool Gelu>
__device__ __forceinline__ void sum_row(T* d, const Vec<T, V>& g, const T* pre, float (&sums)[V]) {
  if constexpr (Gelu) {
    const Vec<T, V> y = *reinterpret_cast<const Vec<T, V>*>(pre);
    Vec<T, V> out;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      out.v[j] = convert<T>(static_cast<float>(to_acc(g.v[j])) * gelu_tanh_slope<T>(to_acc(y.v[j])));
      sums[j] += static_cast<float>(to_acc(out.v[j]));
    }
    *reinterpret_cast<Vec<T, V>*>(d) = out;
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) sums[j] += static_cast<float>(to_acc(g.v[j]));
  }
}

template <typename T, int V, bool Gelu>
__global__ void column_sums_kernel(T* d, const T* pre, int64_t rows, int64_t cols, float* partials) {
  const int64_t nv = cols / V;
  const int64_t cv = int64_t{blockIdx.x} * kColThreads + threadIdx.x;  // this thread's vector of columns
  float sums[V];
#pragma unroll
  for (int j = 0; j < V; ++j) sums[j] = 0.0f;
  if (cv < nv) {
    const int64_t step = int64_t{gridDim.y} * kRowThreads;
    int64_t r = int64_t{blockIdx.y} * kRowThreads + threadIdx.y;
    for (; r + step < rows; r += 2 * step) {  // two rows' loads in flight
      T* d0 = d + r * cols + cv * V;
      T* d1 = d0 + step * cols;
      const Vec<T, V> g0 = *reinterpret_cast<const Vec<T, V>*>(d0), g1 = *reinterpret_cast<const Vec<T, V>*>(d1);
      sum_row<T, V, Gelu>(d0, g0, Gelu ? pre + r * cols + cv * V : nullptr, sums);
      sum_row<T, V, Gelu>(d1, g1, Gelu ? pre + (r + step) * cols + cv * V : nullptr, sums);
    }
    if (r < rows) {
      T* d0 = d + r * cols + cv * V;
      sum_row<T, V, Gelu>(d0, *reinterpret_cast<const Vec<T, V>*>(d0), Gelu ? pre + r * cols + cv * V : nullptr, sums);
    }
  }
  __shared__ float tile[kRowThreads][kColThreads * V];
#pragma unroll
  for (int j = 0; j < V; ++j) tile[threadIdx.y][threadIdx.x * V + j] = sums[j];
  __syncthreads();
  // The block's row lanes summed in order; one partial row per blockIdx.y.
  for (int c = threadIdx.y * kColThreads + threadIdx.x; c < kColThreads * V; c += kRowThreads * kColThreads) {
    const int64_t col = int64_t{blockIdx.x} * kColThreads * V + c;
    if (col >= cols) continue;
    float s = 0.0f;
    for (int i = 0; i < kRowThreads; ++i) s += tile[i][c];
    partials[int64_t{blockIdx.y} * cols + col] = s;
  }
}

// out[col] = the sum of the partial rows' col, in a fixed order: lane y of a
// block sums rows y, y + 8, ...; the lanes are added in order.
template <typename B>
__global__ void sum_partial_rows_kernel(const float* partials, int64_t row_blocks, int64_t cols, B* out) {
  const int64_t col = int64_t{blockIdx.x} * kColThreads + threadIdx.x;
  float s = 0.0f;
  if (col < cols)
    for (int64_t b = threadIdx.y; b < row_blocks; b += kRowThreads) s += partials[b * cols + col];
  __shared__ float lanes[kRowThreads][kColThreads];
  lanes[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || col >= cols) return;
  float total = 0.0f;
  for (int i = 0; i < kRowThreads; ++i) total += lanes[i][threadIdx.x];
  out[col] = convert<B>(total);
}

template <bool Gelu>
void launch_column_sums(const char* op, const Tensor& d, const Tensor& pre, const Tensor& sums) {
  CHORUS_CHECK(d.dim() == 2 && d.is_contiguous() && d.device().is_cuda(), op,
               ": expected a contiguous 2-d CUDA matrix, got ", d.describe());
  if (Gelu)
    CHORUS_CHECK(pre.sizes() == d.sizes() && pre.dtype() == d.dtype() && pre.is_contiguous() &&
                     pre.device() == d.device(),
                 op, ": d and pre must be one contiguous shape and dtype on one device, got ", d.describe(), " and ",
                 pre.describe());
  CHORUS_CHECK(sums.is_contiguous() && sums.numel() == d.size(1) && sums.device() == d.device() &&
                   (sums.dtype() == d.dtype() || sums.dtype() == kFloat32),
               op, ": the sums must be ", d.size(1), " contiguous elements of ", dtype_name(d.dtype()),
               " or float32 on ", d.device().str(), ", got ", sums.describe());
  const int64_t rows = d.size(0), cols = d.size(1);
  if (cols == 0) return;
  const int dev = d.device().index;
  CudaDeviceGuard guard(dev);
  cudaStream_t stream = current_stream(dev);
  dispatch_float(d.dtype(), op, [&]<typename T>() {
    constexpr int kV = 16 / sizeof(T);
    const bool vec = cols % kV == 0 && reinterpret_cast<uintptr_t>(d.raw_data()) % 16 == 0 &&
                     (!Gelu || reinterpret_cast<uintptr_t>(pre.raw_data()) % 16 == 0);
    auto run = [&]<int V>() {
      // Row blocks for ~8 blocks an SM with the column tiles, few enough that
      // the partial rows stay small (<= 256 x cols floats).
      const int64_t col_blocks = (cols / V + kColThreads - 1) / kColThreads;
      const int64_t sms = device_properties(dev).multiProcessorCount;
      const int64_t want = std::max<int64_t>(1, 8 * sms / col_blocks);
      const int64_t row_blocks =
          std::max<int64_t>(1, std::min<int64_t>({kMaxRowBlocks, want, (rows + kRowThreads - 1) / kRowThreads}));
      Tensor partials = detail::empty_tensor({row_blocks, cols}, kFloat32, d.device());
      column_sums_kernel<T, V, Gelu>
          <<<dim3(static_cast<unsigned>(col_blocks), static_cast<unsigned>(row_blocks)), dim3(kColThreads, kRowThreads),
             0, stream>>>(static_cast<T*>(d.raw_data()), Gelu ? pre.data<T>() : nullptr, rows, cols,
                          partials.data<float>());
      CHORUS_CUDA_LAUNCH_CHECK();
      const unsigned fin = static_cast<unsigned>((cols + kColThreads - 1) / kColThreads);
      const dim3 fin_block(kColThreads, kRowThreads);
      if (sums.dtype() == kFloat32) {
        sum_partial_rows_kernel<float><<<fin, fin_block, 0, stream>>>(partials.data<float>(), row_blocks, cols,
                                                                      sums.data<float>());
      } else {
        sum_partial_rows_kernel<T><<<fin, fin_block, 0, stream>>>(partials.data<float>(), row_blocks, cols,
                                                                  sums.data<T>());
      }
      CHORUS_CUDA_LAUNCH_CHECK();
    };
    if (vec) run.template operator()<kV>();
    else run.template operator()<1>();
  });
}

}  // namespace

void column_sums(const Tensor& x, const Tensor& sums) {
  launch_column_sums<false>("column_sums", x, Tensor(), sums);
}

void gelu_tanh_grad_colsum(const Tensor& d, const Tensor& pre, const Tensor& bias_grad) {
  launch_column_sums<true>("gelu_tanh_grad_colsum", d, pre, bias_grad);
}

}  // namespace chorus::cuda
