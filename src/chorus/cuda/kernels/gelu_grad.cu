// GELU's (tanh form) gradient at a GPT MLP's hidden layer together with the
// column sums of that gradient: the first product's bias gradient (Note
// [GELU's gradient with the bias gradient]).
#include <algorithm>
#include <cstdint>

#include "chorus/cuda/kernels/dtype_dispatch.cuh"
#include "chorus/cuda/kernels/gelu_grad.h"
#include "chorus/cuda/kernels/kernels.h"
#include "chorus/cuda/kernels/tensor_iter.cuh"
#include "chorus/cuda/runtime/context.h"

namespace chorus::cuda {

namespace {

// Note [GELU's gradient with the bias gradient]: in a GPT MLP's backward the
// gradient at GELU's input, d = (dy w2) * gelu'(pre), is [tokens, 4C], the
// widest tensor of the block, and its column sums are the first product's
// bias gradient. cuBLASLt's BGRADB epilogue summed them after the weight
// gradient's product as a kernel of its own that read d a second time (12 of
// the 48 bias-gradient kernels of a gpt2 step, the widest ones). Here the
// pass that writes d keeps per-column sums in registers as it goes: each
// thread owns V adjacent columns (one 16-byte vector) and walks rows with a
// stride, the block's rows are summed in shared memory, and a second small
// kernel adds the blocks' partial rows in a fixed order -- no atomics, the
// same bits every run. For 16-bit data tanh is the hardware's tanh.approx
// (~2^-11 relative, below bf16's 2^-9 rounding of d); float32 keeps tanhf.
constexpr int kColThreads = 32;  // threads across columns (one warp: coalesced rows)
constexpr int kRowThreads = 8;   // threads across rows
constexpr int kMaxRowBlocks = 128;

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

template <typename T, int V>
__global__ void gelu_grad_colsum_kernel(T* d, const T* pre, int64_t rows, int64_t cols, float* partials) {
  const int64_t nv = cols / V;
  const int64_t cv = int64_t{blockIdx.x} * kColThreads + threadIdx.x;  // this thread's vector of columns
  float sums[V];
#pragma unroll
  for (int j = 0; j < V; ++j) sums[j] = 0.0f;
  if (cv < nv) {
    const int64_t row_step = int64_t{gridDim.y} * kRowThreads;
    for (int64_t r = int64_t{blockIdx.y} * kRowThreads + threadIdx.y; r < rows; r += row_step) {
      Vec<T, V>* dp = reinterpret_cast<Vec<T, V>*>(d + r * cols) + cv;
      const Vec<T, V> g = *dp, y = reinterpret_cast<const Vec<T, V>*>(pre + r * cols)[cv];
      Vec<T, V> out;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const T v = convert<T>(static_cast<float>(to_acc(g.v[j])) * gelu_tanh_slope<T>(to_acc(y.v[j])));
        out.v[j] = v;
        sums[j] += static_cast<float>(to_acc(v));  // the sums of d as stored
      }
      *dp = out;
    }
  }
  __shared__ float tile[kRowThreads][kColThreads * V];
#pragma unroll
  for (int j = 0; j < V; ++j) tile[threadIdx.y][threadIdx.x * V + j] = sums[j];
  __syncthreads();
  // The block's rows summed in order; one partial row per blockIdx.y.
  for (int c = threadIdx.y * kColThreads + threadIdx.x; c < kColThreads * V; c += kRowThreads * kColThreads) {
    const int64_t col = int64_t{blockIdx.x} * kColThreads * V + c;
    if (col >= cols) continue;
    float s = 0.0f;
    for (int i = 0; i < kRowThreads; ++i) s += tile[i][c];
    partials[int64_t{blockIdx.y} * cols + col] = s;
  }
}

template <typename B>
__global__ void sum_partial_rows_kernel(const float* partials, int64_t row_blocks, int64_t cols, B* out) {
  const int64_t col = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  float s = 0.0f;
  for (int64_t b = 0; b < row_blocks; ++b) s += partials[b * cols + col];
  out[col] = convert<B>(s);
}

}  // namespace

void gelu_tanh_grad_colsum(const Tensor& d, const Tensor& pre, const Tensor& bias_grad) {
  const char* op = "gelu_tanh_grad_colsum";
  CHORUS_CHECK(d.dim() == 2 && pre.sizes() == d.sizes() && pre.dtype() == d.dtype() && d.is_contiguous() &&
                   pre.is_contiguous() && d.device().is_cuda() && pre.device() == d.device(),
               op, ": d and pre must be one contiguous 2-d CUDA shape and dtype, got ", d.describe(), " and ",
               pre.describe());
  CHORUS_CHECK(bias_grad.is_contiguous() && bias_grad.numel() == d.size(1) && bias_grad.device() == d.device() &&
                   (bias_grad.dtype() == d.dtype() || bias_grad.dtype() == kFloat32),
               op, ": the bias gradient must be ", d.size(1), " contiguous elements of ", dtype_name(d.dtype()),
               " or float32 on ", d.device().str(), ", got ", bias_grad.describe());
  const int64_t rows = d.size(0), cols = d.size(1);
  if (cols == 0) return;
  const int dev = d.device().index;
  CudaDeviceGuard guard(dev);
  cudaStream_t stream = current_stream(dev);
  dispatch_float(d.dtype(), op, [&]<typename T>() {
    constexpr int kV = 16 / sizeof(T);
    const bool vec = cols % kV == 0 && reinterpret_cast<uintptr_t>(d.raw_data()) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(pre.raw_data()) % 16 == 0;
    auto run = [&]<int V>() {
      // Enough row blocks for ~8 blocks an SM with the column tiles, few
      // enough that the partial rows stay small (<= 128 x cols floats).
      const int64_t col_blocks = (cols / V + kColThreads - 1) / kColThreads;
      const int64_t sms = device_properties(dev).multiProcessorCount;
      const int64_t want = std::max<int64_t>(1, 8 * sms / std::max<int64_t>(col_blocks, 1));
      const int64_t row_blocks =
          std::max<int64_t>(1, std::min<int64_t>({kMaxRowBlocks, want, (rows + kRowThreads - 1) / kRowThreads}));
      Tensor partials = detail::empty_tensor({row_blocks, cols}, kFloat32, d.device());
      gelu_grad_colsum_kernel<T, V>
          <<<dim3(static_cast<unsigned>(col_blocks), static_cast<unsigned>(row_blocks)), dim3(kColThreads, kRowThreads),
             0, stream>>>(d.data<T>(), pre.data<T>(), rows, cols, partials.data<float>());
      CHORUS_CUDA_LAUNCH_CHECK();
      const unsigned fin = static_cast<unsigned>((cols + 255) / 256);
      if (bias_grad.dtype() == kFloat32) {
        sum_partial_rows_kernel<float><<<fin, 256, 0, stream>>>(partials.data<float>(), row_blocks, cols,
                                                                bias_grad.data<float>());
      } else {
        sum_partial_rows_kernel<T><<<fin, 256, 0, stream>>>(partials.data<float>(), row_blocks, cols,
                                                            bias_grad.data<T>());
      }
      CHORUS_CUDA_LAUNCH_CHECK();
    };
    if (vec) run.template operator()<kV>();
    else run.template operator()<1>();
  });
}

}  // namespace chorus::cuda
