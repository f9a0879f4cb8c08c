// Row-wise reductions for the CUDA kernels that work a row at a time
// (softmax, cross entropy, layer norm, attention's softmax, the fused
// classifier). A warp handles a row of up to kWarpCols columns (kRowsPerBlock
// rows per block), a block of kBlockThreads threads a longer one; row_launch
// picks the layout and row_allreduce reduces over the threads of a row in
// either. MaxSumV is the "online" softmax's running max and sum of
// exp(x - max): the sum is rescaled whenever the max grows. with_row_vector
// and check_cuda_contiguous are the launchers' side, shared by the row
// kernels of transformer.cu and layer_norm_forward.cu and layer_norm_backward.cu.
#pragma once

#include <cmath>
#include <cstdint>
#include <initializer_list>

#include "chorus/core/error.h"
#include "chorus/core/tensor.h"

namespace chorus::cuda {
namespace {

constexpr int64_t kWarpCols = 1024;
constexpr int kRowsPerBlock = 8;     // warp-per-row layout: blockDim = (32, 8)
constexpr int kBlockThreads = 256;   // block-per-row layout: blockDim = (256, 1)

__device__ __forceinline__ float shfl_xor(float v, int mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}

struct SumV {
  float s;
  __device__ static SumV merge(SumV a, SumV b) { return {a.s + b.s}; }
  __device__ SumV shfl(int mask) const { return {shfl_xor(s, mask)}; }
};

// Running max and sum of exp(x - max); -inf max means "no finite element yet".
struct MaxSumV {
  float m, s;
  __device__ static float rescale(float s, float m_old, float m_new) {
    return m_old == -INFINITY ? 0.0f : s * expf(m_old - m_new);
  }
  __device__ static MaxSumV merge(MaxSumV a, MaxSumV b) {
    const float m = fmaxf(a.m, b.m);
    if (m == -INFINITY) return {m, a.s + b.s};
    return {m, rescale(a.s, a.m, m) + rescale(b.s, b.m, m)};
  }
  __device__ MaxSumV add(float v) const {
    if (v != v) return {v, v};  // NaN poisons the row, as in PyTorch
    if (v > m) return {v, rescale(s, m, v) + 1.0f};
    if (v == -INFINITY) return *this;
    return {m, s + expf(v - m)};
  }
  __device__ MaxSumV shfl(int mask) const { return {shfl_xor(m, mask), shfl_xor(s, mask)}; }
};

// Reduces v over the threads of a row (threadIdx.x); every thread gets the result.
template <typename V>
__device__ __forceinline__ V row_allreduce(V v) {
#pragma unroll
  for (int mask = 16; mask > 0; mask /= 2) v = V::merge(v, v.shfl(mask));
  if (blockDim.x > 32) {
    __shared__ V warp_results[32];  // up to 1024 threads a row
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) warp_results[warp] = v;
    __syncthreads();
    v = warp_results[0];
    for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) v = V::merge(v, warp_results[w]);
    __syncthreads();
  }
  return v;
}

// The row this thread works on, in either layout.
__device__ __forceinline__ int64_t row_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
}

struct RowLaunch {
  dim3 grid, block;
};
inline RowLaunch row_launch(int64_t rows, int64_t cols) {
  if (cols <= kWarpCols) {
    return {dim3(static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock)),
            dim3(32, kRowsPerBlock)};
  }
  CHORUS_CHECK(rows < (int64_t{1} << 31), "row kernel: too many rows (", rows, ")");
  return {dim3(static_cast<unsigned>(rows)), dim3(kBlockThreads, 1)};
}

// Runs f.template operator()<V>() with the widest V (16 bytes of T, a
// Vec<T, V> of tensor_iter.cuh) that divides the row length s and every
// pointer's alignment (null counts as aligned), else V = 1.
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

inline void check_cuda_contiguous(const Tensor& t, const char* op, const char* arg) {
  CHORUS_CHECK(t.device().is_cuda() && t.is_contiguous(), op, ": ", arg, " must be a contiguous CUDA tensor, got ",
               t.describe());
}

}  // namespace
}  // namespace chorus::cuda
