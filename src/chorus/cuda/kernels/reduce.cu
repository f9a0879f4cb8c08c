// Reductions of the CUDA kernel set: sum, mean, max, min, argmax, argmin over
// any set of dims of a strided tensor.
//
// The dims of x split into kept dims (one output element per index) and
// reduced dims, each side collapsed on its own (tensor_iter.cuh). Two kernels
// cover the layouts that matter:
//   - row: the reduced elements are the closer ones in memory (sum over the
//     last dim, per-channel sums over N,H,W of NCHW, full reductions): a warp
//     or a block cooperates on each output and reads along the reduction;
//   - column: the outputs are the closer ones (sum over dim 0 of [N, C]): each
//     thread owns one output, so a warp reads 32 adjacent outputs at a time,
//     and threads along y share the reduction.
// When there are too few outputs to fill the GPU, the reduction is split over
// blocks (grid.y) into partial results that a second kernel combines, so a
// full reduction of a large tensor uses every SM.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>

#include "chorus/core/storage.h"
#include "chorus/cuda/runtime/context.h"
#include "chorus/cuda/kernels/column_sums.h"
#include "chorus/cuda/kernels/dtype_dispatch.cuh"
#include "chorus/cuda/kernels/kernels.h"
#include "chorus/cuda/kernels/tensor_iter.cuh"

namespace chorus::cuda {

namespace {

struct ReduceGeom {
  OffsetCalc<1> kept;  // output index -> offset of its first element in x
  OffsetCalc<1> red;   // reduction index -> offset from there
  int64_t num_out;
  int64_t red_n;
};

__device__ __forceinline__ int64_t red_offset(const ReduceGeom& g, int64_t r) {
  if (g.red.ndim <= 1) return g.red.ndim == 0 ? 0 : r * g.red.strides[0][0];
  return g.red.get(r).v[0];
}

// acc_t is float or double, so NaN and infinities exist for every dtype.
template <typename A>
__device__ __forceinline__ bool is_nan(A v) {
  return v != v;
}

// ---- reduction ops: init, step (one element), merge (two partials), project --------

template <typename T>
struct SumOp {
  using acc = acc_t<T>;
  using out_t = T;
  bool mean;
  __device__ acc init() const { return acc(0); }
  __device__ acc step(acc a, acc v, int64_t) const { return a + v; }
  __device__ acc merge(acc a, acc b) const { return a + b; }
  __device__ out_t project(acc a, int64_t count) const {
    return convert<T>(mean ? a / static_cast<acc>(count) : a);  // integers: truncated, as on the CPU
  }
};

// Max (is_max) or min; NaN wins, as in PyTorch.
template <typename T>
struct ExtremumOp {
  using acc = acc_t<T>;
  using out_t = T;
  bool is_max;
  __device__ acc init() const { return is_max ? -INFINITY : INFINITY; }
  __device__ acc merge(acc a, acc b) const {
    if (is_nan(a)) return a;
    if (is_nan(b)) return b;
    return is_max ? (b > a ? b : a) : (b < a ? b : a);
  }
  __device__ acc step(acc a, acc v, int64_t) const { return merge(a, v); }
  __device__ out_t project(acc a, int64_t) const { return convert<T>(a); }
};

template <typename A>
struct ArgAcc {
  A v;
  int64_t i;  // kEmpty before the first element
};
constexpr int64_t kEmpty = std::numeric_limits<int64_t>::max();

// Index of the max (is_max) or min along the one reduced dim: the first one on
// ties; a NaN counts as the extremum, as in PyTorch.
template <typename T>
struct ArgOp {
  using A = acc_t<T>;
  using acc = ArgAcc<A>;
  using out_t = int64_t;
  bool is_max;
  __device__ bool better(const acc& b, const acc& a) const {
    if (a.i == kEmpty) return true;
    if (b.i == kEmpty) return false;
    if (is_nan(a.v)) return is_nan(b.v) && b.i < a.i;
    if (is_nan(b.v)) return true;
    if (b.v != a.v) return is_max ? b.v > a.v : b.v < a.v;
    return b.i < a.i;
  }
  __device__ acc init() const { return acc{A(0), kEmpty}; }
  __device__ acc merge(acc a, acc b) const { return better(b, a) ? b : a; }
  __device__ acc step(acc a, A v, int64_t i) const { return merge(a, acc{v, i}); }
  __device__ out_t project(acc a, int64_t) const { return a.i == kEmpty ? 0 : a.i; }
};

template <typename A>
__device__ __forceinline__ A shfl_down(A v, int delta) {
  return __shfl_down_sync(0xffffffffu, v, delta);
}
template <typename A>
__device__ __forceinline__ ArgAcc<A> shfl_down(ArgAcc<A> v, int delta) {
  return ArgAcc<A>{__shfl_down_sync(0xffffffffu, v.v, delta),
                   __shfl_down_sync(0xffffffffu, v.i, delta)};
}

template <typename Op>
__device__ __forceinline__ typename Op::acc warp_reduce(const Op& op, typename Op::acc a) {
#pragma unroll
  for (int d = 16; d > 0; d /= 2) a = op.merge(a, shfl_down(a, d));
  return a;
}

// ---- kernels -------------------------------------------------------------------------

constexpr int kRowSmall = 32;  // threads per output for short rows (8 outputs per block)
constexpr int kRowLarge = 256; // threads per output for long rows (one per block)
constexpr int kColY = 8;       // threads sharing one output's reduction in column mode

struct Split {
  int64_t begin, end;
};
__device__ __forceinline__ Split split_range(int64_t n, int64_t splits) {
  const int64_t chunk = (n + splits - 1) / splits;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * chunk;
  return {begin, begin + chunk < n ? begin + chunk : n};
}

// blockDim = (kRowSmall, 256 / kRowSmall) or (kRowLarge, 1).
template <typename T, typename Op>
__global__ void reduce_row_kernel(const T* x, ReduceGeom g, Op op, typename Op::out_t* out,
                                  typename Op::acc* partial) {
  using Acc = typename Op::acc;
  const int64_t o = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const Split sp = split_range(g.red_n, gridDim.y);
  Acc a = op.init();
  if (o < g.num_out) {
    const int64_t base = g.kept.get(o).v[0];
    for (int64_t r = sp.begin + threadIdx.x; r < sp.end; r += blockDim.x)
      a = op.step(a, to_acc(x[base + red_offset(g, r)]), r);
  }
  a = warp_reduce(op, a);
  if (blockDim.x > 32) {  // one output per block: combine the warps
    __shared__ Acc warp_results[kRowLarge / 32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) warp_results[warp] = a;
    __syncthreads();
    if (warp == 0) {
      a = lane < static_cast<int>(blockDim.x / 32) ? warp_results[lane] : op.init();
      a = warp_reduce(op, a);
    }
  }
  if (threadIdx.x == 0 && o < g.num_out) {
    if (partial) partial[o * gridDim.y + blockIdx.y] = a;
    else out[o] = op.project(a, g.red_n);
  }
}

// blockDim = (32, kColY).
template <typename T, typename Op>
__global__ void reduce_col_kernel(const T* x, ReduceGeom g, Op op, typename Op::out_t* out,
                                  typename Op::acc* partial) {
  using Acc = typename Op::acc;
  __shared__ Acc shared[kColY][32];
  const int64_t o = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const Split sp = split_range(g.red_n, gridDim.y);
  Acc a = op.init();
  if (o < g.num_out) {
    const int64_t base = g.kept.get(o).v[0];
    for (int64_t r = sp.begin + threadIdx.y; r < sp.end; r += kColY)
      a = op.step(a, to_acc(x[base + red_offset(g, r)]), r);
  }
  shared[threadIdx.y][threadIdx.x] = a;
  __syncthreads();
  if (threadIdx.y == 0 && o < g.num_out) {
    for (int y = 1; y < kColY; ++y) a = op.merge(a, shared[y][threadIdx.x]);
    if (partial) partial[o * gridDim.y + blockIdx.y] = a;
    else out[o] = op.project(a, g.red_n);
  }
}

// Combines the `splits` partial results of each output (in split order).
template <typename Op>
__global__ void reduce_finish_kernel(const typename Op::acc* partial, int64_t splits,
                                     int64_t num_out, int64_t red_n, Op op,
                                     typename Op::out_t* out) {
  for (int64_t o = global_thread_id(); o < num_out; o += grid_stride()) {
    typename Op::acc a = op.init();
    for (int64_t s = 0; s < splits; ++s) a = op.merge(a, partial[o * splits + s]);
    out[o] = op.project(a, red_n);
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <typename T, typename Op>
void launch_reduce(const Tensor& x, const Tensor& out, const std::vector<bool>& reduce, Op op) {
  using Acc = typename Op::acc;
  using Out = typename Op::out_t;

  Shape kept_sizes, kept_strides, red_sizes, red_strides;
  for (size_t d = 0; d < reduce.size(); ++d) {
    (reduce[d] ? red_sizes : kept_sizes).push_back(x.sizes()[d]);
    (reduce[d] ? red_strides : kept_strides).push_back(x.strides()[d]);
  }
  ReduceGeom g;
  g.kept = make_offset_calc<1>(kept_sizes, {kept_strides});
  g.red = make_offset_calc<1>(red_sizes, {red_strides});
  g.num_out = numel_of(kept_sizes);
  g.red_n = numel_of(red_sizes);
  if (g.num_out == 0) return;

  const int dev = out.device().index;
  CudaDeviceGuard guard(dev);
  cudaStream_t stream = current_stream(dev);
  const int64_t target_blocks = 4 * int64_t{device_properties(dev).multiProcessorCount};

  // Row mode when the reduction runs along the smaller stride.
  const int64_t red_inner = g.red.ndim > 0 ? g.red.strides[0][0] : 0;
  const int64_t kept_inner = g.kept.ndim > 0 ? g.kept.strides[0][0] : 0;
  const bool row = g.num_out == 1 || g.red.ndim == 0 || red_inner < kept_inner;

  dim3 block;
  int64_t out_blocks;
  if (row) {
    block = g.red_n <= 512 ? dim3(kRowSmall, kThreads / kRowSmall) : dim3(kRowLarge, 1);
    out_blocks = ceil_div(g.num_out, block.y);
  } else {
    block = dim3(32, kColY);
    out_blocks = ceil_div(g.num_out, 32);
  }
  CHORUS_CHECK(out_blocks < (int64_t{1} << 31), "reduce: too many outputs (", g.num_out, ")");
  // Split the reduction over blocks only while each thread keeps >= 32 elements.
  const int64_t threads_per_out = row ? block.x : block.y;
  int64_t splits = 1;
  if (out_blocks < target_blocks) {
    splits = std::min({ceil_div(target_blocks, out_blocks),
                       std::max<int64_t>(1, g.red_n / (threads_per_out * 32)), int64_t{65535}});
  }

  const T* xp = static_cast<const T*>(x.raw_data());
  Out* op_out = static_cast<Out*>(out.raw_data());
  std::unique_ptr<Storage> scratch;
  Acc* partial = nullptr;
  if (splits > 1) {
    // Freed on this stream after the kernels below: stream order makes it safe.
    scratch = std::make_unique<Storage>(static_cast<size_t>(g.num_out * splits) * sizeof(Acc),
                                        out.device());
    partial = static_cast<Acc*>(scratch->data());
  }
  const dim3 grid(static_cast<unsigned>(out_blocks), static_cast<unsigned>(splits));
  if (row) reduce_row_kernel<T, Op><<<grid, block, 0, stream>>>(xp, g, op, op_out, partial);
  else reduce_col_kernel<T, Op><<<grid, block, 0, stream>>>(xp, g, op, op_out, partial);
  CHORUS_CUDA_LAUNCH_CHECK();
  if (partial) {
    reduce_finish_kernel<Op><<<grid_for(g.num_out), kThreads, 0, stream>>>(
        partial, splits, g.num_out, g.red_n, op, op_out);
    CHORUS_CUDA_LAUNCH_CHECK();
  }
}

}  // namespace

void reduce(ReduceOp op, const Tensor& x, const Tensor& out, const std::vector<bool>& reduce) {
  CHORUS_CHECK(x.device() == out.device() && x.device().is_cuda(),
               "reduce: tensors must be on one CUDA device, got ", x.describe(), " and ",
               out.describe());
  CHORUS_CHECK(static_cast<int64_t>(reduce.size()) == x.dim(), "reduce: ", reduce.size(),
               " reduce flags for a ", x.dim(), "-d tensor");
  CHORUS_CHECK(out.is_contiguous(), "reduce: the output must be contiguous");
  int64_t expect = 1, n_reduced = 0;
  for (size_t d = 0; d < reduce.size(); ++d) {
    expect *= reduce[d] ? 1 : x.sizes()[d];
    n_reduced += reduce[d] ? 1 : 0;
  }
  CHORUS_CHECK(out.numel() == expect, "reduce: output ", out.describe(),
               " does not match the kept dims of ", x.describe());

  CHORUS_CHECK(x.numel() > 0 || op == ReduceOp::Sum || op == ReduceOp::Mean || out.numel() == 0,
               "reduce: cannot take max/min/argmax of an empty dimension of ", x.describe());
  if (op == ReduceOp::Argmax || op == ReduceOp::Argmin) {
    CHORUS_CHECK(n_reduced == 1, "argmax/argmin reduce exactly one dim, got ", n_reduced);
    CHORUS_CHECK(out.dtype() == kInt64, "argmax/argmin: the output must be int64, got ",
                 out.describe());
    dispatch_all(x.dtype(), "argmax", [&]<typename T>() {
      launch_reduce<T>(x, out, reduce, ArgOp<T>{op == ReduceOp::Argmax});
    });
    return;
  }
  CHORUS_CHECK(out.dtype() == x.dtype(), "reduce: output dtype ", out.dtype(), " differs from ",
               x.dtype());
  // Note [Leading dimensions summed as columns]: the sum over the leading
  // dimensions of a contiguous floating tensor -- a broadcast add's gradient,
  // as the GPT's position embedding gets from [batch, seq, width] -- is the
  // column sums of a [rows, cols] matrix, which column_sums.cu reads a
  // 16-byte vector a thread in a fixed order. The column kernel above reads
  // one element a thread through the geometry's divisions: gpt2's [16, 1024 x
  // 768] bf16 took 59 us on an H200 (benchmarks journal, session 42). Both
  // sum in float32 for these dtypes (in different orders).
  int64_t lead = 0;
  while (lead < x.dim() && reduce[static_cast<size_t>(lead)]) ++lead;
  const bool leading_only = lead == n_reduced && lead > 0 && lead < x.dim();
  if (op == ReduceOp::Sum && leading_only && x.is_contiguous() && x.numel() > 0 &&
      (x.dtype() == kFloat32 || x.dtype() == kBFloat16 || x.dtype() == kFloat16)) {
    const int64_t cols = out.numel(), rows = x.numel() / cols;
    column_sums(detail::make_view(x, {rows, cols}, {cols, 1}, x.storage_offset()),
                detail::make_view(out, {cols}, {1}, out.storage_offset()));
    return;
  }
  dispatch_all(x.dtype(), "reduce", [&]<typename T>() {
    if (op == ReduceOp::Sum || op == ReduceOp::Mean) {
      launch_reduce<T>(x, out, reduce, SumOp<T>{op == ReduceOp::Mean});
    } else {
      launch_reduce<T>(x, out, reduce, ExtremumOp<T>{op == ReduceOp::Max});
    }
  });
}

}  // namespace chorus::cuda
