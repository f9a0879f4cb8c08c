// sum_squares_multi and scale_multi of the CUDA kernel set: gradient
// clipping's norm and scale over every gradient in a few launches.
//
// Note [Clipping in a few launches]: clip_grad_norm_ took, per gradient, a
// square, a reduction, an add of the partial norms and a scale -- 4 launches
// and 2.5 passes over the gradient each, 2,300 launches a step for gpt2-xl's
// 580 parameters (benchmarks journal, session 32). Here a launch takes up to
// kTensors tensors (their table travels as the kernel argument). For the
// scale, blockIdx.y picks the tensor and the blocks along x stride over it;
// the sums of squares go a block a chunk (Note [Squares in chunks]) and land
// in per-block partials, added by one block in a fixed order: the norm is the
// same from run to run.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "chorus/core/error.h"
#include "chorus/cuda/runtime/context.h"
#include "chorus/cuda/kernels/dtype_dispatch.cuh"
#include "chorus/cuda/kernels/kernels.h"
#include "chorus/cuda/kernels/tensor_iter.cuh"

namespace chorus::cuda {

namespace {

constexpr int kTensors = 64;
constexpr int kBlocksPerTensor = 128;  // about one per SM of an H100 for a large tensor

struct Table {
  void* ptr[kTensors];
  int64_t numel[kTensors];
};
static_assert(sizeof(Table) < 4000, "kernel parameters too large");

template <typename Acc>
__device__ Acc block_sum(Acc v) {
  __shared__ Acc shared[kThreads / 32];
  for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = threadIdx.x < kThreads / 32 ? shared[threadIdx.x] : Acc(0);
  if (warp == 0)
    for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}

// Note [Squares in chunks]: sum_squares_multi's blocks each take one chunk
// of kSquaresChunk elements of one tensor (its table names each tensor's
// first block, as the multi-tensor optimizers' do), so a large tensor gets
// as many blocks as it has chunks: with a fixed 128 blocks a tensor, gpt2's
// [50304, 768] embedding gradient ran on about one block an SM and the
// norm's three launches took 152 us of an H200 step (benchmarks journal,
// session 42). A chunk of a 16-byte aligned tensor is read a 16-byte vector
// at a time, four vectors in flight a thread (a gpt2 step's 124M float32
// gradients took 0.22 ms in scalar loads, session 40), the rest and a
// misaligned tensor an element at a time. Each block writes one partial;
// the sum's order depends only on the shapes and the alignment: the same
// norm from run to run.
constexpr int64_t kSquaresChunk = 16384;

struct ChunkTable {
  const void* ptr[kTensors];
  int64_t numel[kTensors];
  int32_t first_block[kTensors];
  int32_t tensors;
};
static_assert(sizeof(ChunkTable) < 4000, "kernel parameters too large");

template <typename T, typename Acc>
__global__ void __launch_bounds__(kThreads) sum_squares_kernel(ChunkTable t, Acc* partials) {
  constexpr int V = 16 / sizeof(T);
  int k = 0;
  while (k + 1 < t.tensors && t.first_block[k + 1] <= static_cast<int32_t>(blockIdx.x)) ++k;
  const T* x = static_cast<const T*>(t.ptr[k]);
  const int64_t begin = int64_t{static_cast<int32_t>(blockIdx.x) - t.first_block[k]} * kSquaresChunk;
  const int64_t end = min(t.numel[k], begin + kSquaresChunk);
  const int64_t bd = blockDim.x;
  Acc s = 0;
  auto add = [&s](const Vec<T, V>& v) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const Acc a = static_cast<Acc>(to_acc(v.v[j]));
      s += a * a;
    }
  };
  int64_t tail = begin;
  if (reinterpret_cast<uintptr_t>(x) % 16 == 0) {  // begin is a multiple of V
    const int64_t nv = (end - begin) / V;
    const Vec<T, V>* xv = reinterpret_cast<const Vec<T, V>*>(x + begin);
    int64_t i = threadIdx.x;
    for (; i + 3 * bd < nv; i += 4 * bd) {
      const Vec<T, V> a = xv[i], b = xv[i + bd], c = xv[i + 2 * bd], d = xv[i + 3 * bd];
      add(a);
      add(b);
      add(c);
      add(d);
    }
    for (; i < nv; i += bd) add(xv[i]);
    tail = begin + nv * V;
  }
  for (int64_t i = tail + threadIdx.x; i < end; i += bd) {
    const Acc v = static_cast<Acc>(to_acc(x[i]));
    s += v * v;
  }
  s = block_sum(s);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

template <typename Acc, typename Out>
__global__ void __launch_bounds__(kThreads) sum_partials_kernel(const Acc* partials, int64_t n, Out* out) {
  // Four partials loaded before any is added (the same order of adds).
  Acc s = 0;
  const int64_t bd = blockDim.x;
  int64_t i = threadIdx.x;
  for (; i + 3 * bd < n; i += 4 * bd) {
    const Acc a = partials[i], b = partials[i + bd], c = partials[i + 2 * bd], d = partials[i + 3 * bd];
    s += a;
    s += b;
    s += c;
    s += d;
  }
  for (; i < n; i += bd) s += partials[i];
  s = block_sum(s);
  if (threadIdx.x == 0) *out = static_cast<Out>(s);
}

template <typename T, typename S>
__global__ void __launch_bounds__(kThreads) scale_kernel(Table t, const S* scale) {
  T* x = static_cast<T*>(t.ptr[blockIdx.y]);
  const int64_t n = t.numel[blockIdx.y];
  const S c = *scale;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    x[i] = convert<T>(static_cast<S>(to_acc(x[i])) * c);
}

// Runs f.template operator()<T>() for the element type of one dtype,
// float64 included (gradient checks run clipping in float64).
template <typename F>
void dispatch_with_double(DType dt, const char* op, F&& f) {
  if (dt == kFloat64) return f.template operator()<double>();
  dispatch_float(dt, op, static_cast<F&&>(f));
}

// Calls take(run, dtype) for runs of the non-empty tensors of xs that share a
// dtype, in order; take keeps the tensors it can (a prefix of run, at least
// one) and returns how many, and the rest go into later runs.
template <typename Take>
void for_each_run(const TensorList& xs, const char* op, Take&& take) {
  std::vector<const Tensor*> todo;
  for (const Tensor& x : xs) {
    CHORUS_CHECK(x.device().is_cuda() && x.is_contiguous() && is_floating(x.dtype()), op,
                 ": tensors must be contiguous floating CUDA tensors, got ", x.describe());
    if (x.numel() > 0) todo.push_back(&x);
  }
  while (!todo.empty()) {
    const DType dt = todo.front()->dtype();
    std::vector<const Tensor*> run, rest;
    for (const Tensor* x : todo) (x->dtype() == dt ? run : rest).push_back(x);
    const size_t kept = take(run, dt);
    rest.insert(rest.begin(), run.begin() + static_cast<std::ptrdiff_t>(kept), run.end());
    todo.swap(rest);
  }
}

// Calls launch(table, count, dtype) for each run of up to kTensors non-empty
// tensors of one dtype.
template <typename L>
void for_each_batch(const TensorList& xs, const char* op, L&& launch) {
  for_each_run(xs, op, [&](const std::vector<const Tensor*>& run, DType dt) {
    Table t{};
    const int count = static_cast<int>(std::min<size_t>(run.size(), kTensors));
    for (int k = 0; k < count; ++k) {
      t.ptr[k] = run[static_cast<size_t>(k)]->raw_data();
      t.numel[k] = run[static_cast<size_t>(k)]->numel();
    }
    launch(t, count, dt);
    return static_cast<size_t>(count);
  });
}

// Calls launch(table, blocks, dtype) for each run of up to kTensors non-empty
// tensors of one dtype, a block a chunk of kSquaresChunk elements (Note
// [Squares in chunks]).
template <typename L>
void for_each_chunk_batch(const TensorList& xs, const char* op, L&& launch) {
  for_each_run(xs, op, [&](const std::vector<const Tensor*>& run, DType dt) {
    ChunkTable t{};
    int64_t blocks = 0;
    for (const Tensor* x : run) {
      const int64_t chunks = (x->numel() + kSquaresChunk - 1) / kSquaresChunk;
      CHORUS_CHECK(chunks < (int64_t{1} << 30), op, ": a tensor of ", x->numel(),
                   " elements is more than one launch sums");
      // A launch's blocks stay well inside the grid's 2^31 - 1.
      if (t.tensors == kTensors || blocks + chunks >= (int64_t{1} << 30)) break;
      t.ptr[t.tensors] = x->raw_data();
      t.numel[t.tensors] = x->numel();
      t.first_block[t.tensors] = static_cast<int32_t>(blocks);
      ++t.tensors;
      blocks += chunks;
    }
    launch(t, blocks, dt);
    return static_cast<size_t>(t.tensors);
  });
}

}  // namespace

void sum_squares_multi(const TensorList& xs, const Tensor& out) {
  const char* op = "sum_squares_multi";
  CHORUS_CHECK(out.device().is_cuda() && out.numel() == 1 && (out.dtype() == kFloat32 || out.dtype() == kFloat64), op,
               ": out must be one float32 or float64 element on a CUDA device, got ", out.describe());
  const int dev = out.device().index;
  CudaDeviceGuard guard(dev);
  cudaStream_t stream = current_stream(dev);
  const bool wide = out.dtype() == kFloat64;
  const size_t acc_size = wide ? sizeof(double) : sizeof(float);
  int64_t total = 0;
  for_each_chunk_batch(xs, op, [&](const ChunkTable&, int64_t blocks, DType) { total += blocks; });
  if (total == 0) {
    CHORUS_CUDA_CHECK(cudaMemsetAsync(out.raw_data(), 0, out.element_size(), stream));
    return;
  }
  // One partial a block, every one written: freed on this stream after the kernels below.
  Tensor partials = detail::empty_tensor({total * static_cast<int64_t>(acc_size)}, kUInt8, out.device());
  int64_t done = 0;
  for_each_chunk_batch(xs, op, [&](const ChunkTable& t, int64_t blocks, DType dt) {
    char* base = static_cast<char*>(partials.raw_data()) + done * static_cast<int64_t>(acc_size);
    const unsigned grid = static_cast<unsigned>(blocks);
    dispatch_with_double(dt, op, [&]<typename T>() {
      if (wide) {
        sum_squares_kernel<T, double><<<grid, kThreads, 0, stream>>>(t, reinterpret_cast<double*>(base));
      } else {
        sum_squares_kernel<T, float><<<grid, kThreads, 0, stream>>>(t, reinterpret_cast<float*>(base));
      }
    });
    CHORUS_CUDA_LAUNCH_CHECK();
    done += blocks;
  });
  if (wide) {
    sum_partials_kernel<double, double><<<1, kThreads, 0, stream>>>(static_cast<const double*>(partials.raw_data()),
                                                                    total, out.data<double>());
  } else {
    sum_partials_kernel<float, float><<<1, kThreads, 0, stream>>>(static_cast<const float*>(partials.raw_data()), total,
                                                                  out.data<float>());
  }
  CHORUS_CUDA_LAUNCH_CHECK();
}

void scale_multi(const TensorList& xs, const Tensor& scale) {
  const char* op = "scale_multi";
  CHORUS_CHECK(scale.device().is_cuda() && scale.numel() == 1 && (scale.dtype() == kFloat32 || scale.dtype() == kFloat64),
               op, ": scale must be one float32 or float64 element on a CUDA device, got ", scale.describe());
  const int dev = scale.device().index;
  CudaDeviceGuard guard(dev);
  cudaStream_t stream = current_stream(dev);
  for_each_batch(xs, op, [&](const Table& t, int count, DType dt) {
    const dim3 grid(kBlocksPerTensor, count);
    dispatch_with_double(dt, op, [&]<typename T>() {
      if (scale.dtype() == kFloat64) {
        scale_kernel<T, double><<<grid, kThreads, 0, stream>>>(t, scale.data<double>());
      } else {
        scale_kernel<T, float><<<grid, kThreads, 0, stream>>>(t, scale.data<float>());
      }
    });
    CHORUS_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace chorus::cuda
