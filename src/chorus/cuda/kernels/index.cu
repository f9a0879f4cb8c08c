// Indexing kernels of the CUDA kernel set: index_select, index_add, gather,
// scatter_add. index tensors are int64.
//
// index_select/index_add view their tensors as [outer, dim, inner]; gather and
// scatter_add walk the index tensor's shape with an offset calculator whose
// stride along `dim` is zero for the indexed tensor, then add index * stride.
// The selecting kernels only move elements, so they are instantiated per
// element size, not per dtype. The adding kernels use atomics: with repeated
// indices the float sums come out in no fixed order.
//
// An index outside [0, size) is not an error the GPU can raise without killing
// the context: selecting kernels write 0 for it and adding kernels skip it.
#include <algorithm>
#include <cstdint>

#include "chorus/cuda/runtime/context.h"
#include "chorus/cuda/kernels/dtype_dispatch.cuh"
#include "chorus/cuda/kernels/kernels.h"
#include "chorus/cuda/kernels/tensor_iter.cuh"

namespace chorus::cuda {

namespace {

// ---- atomic accumulation per element type -----------------------------------------

__device__ __forceinline__ void atomic_add(float* p, float v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(bf16* p, bf16 v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(fp16* p, fp16 v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(int32_t* p, int32_t v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(int64_t* p, int64_t v) {
  // Two's complement: unsigned wrap-around addition is signed addition.
  atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
}
// Bytes: compare-and-swap on the aligned 32-bit word that holds them (device
// allocations are at least 256-byte aligned, so the word is ours to touch).
__device__ __forceinline__ void atomic_add(uint8_t* p, uint8_t v) {
  auto* word = reinterpret_cast<unsigned int*>(reinterpret_cast<uintptr_t>(p) & ~uintptr_t{3});
  const unsigned shift = (reinterpret_cast<uintptr_t>(p) & 3u) * 8u;
  unsigned int old = *word, assumed;
  do {
    assumed = old;
    const unsigned int sum = ((assumed >> shift) + v) & 0xffu;
    old = atomicCAS(word, assumed, (assumed & ~(0xffu << shift)) | (sum << shift));
  } while (old != assumed);
}
__device__ __forceinline__ void atomic_add(bool* p, bool v) {  // logical or
  if (!v) return;
  auto* word = reinterpret_cast<unsigned int*>(reinterpret_cast<uintptr_t>(p) & ~uintptr_t{3});
  atomicOr(word, 1u << ((reinterpret_cast<uintptr_t>(p) & 3u) * 8u));
}

// ---- kernels -----------------------------------------------------------------------------

// A 0-d tensor acts as shape [1], as in PyTorch (and the CPU kernels).
Shape dims_of(const Tensor& t) { return t.dim() == 0 ? Shape{1} : t.sizes(); }

struct Dim3View {
  int64_t outer, size, inner;
};
Dim3View view_around(const Tensor& t, int64_t dim) {
  const Shape s = dims_of(t);
  Dim3View v{1, s[static_cast<size_t>(dim)], 1};
  for (int64_t d = 0; d < dim; ++d) v.outer *= s[static_cast<size_t>(d)];
  for (size_t d = static_cast<size_t>(dim) + 1; d < s.size(); ++d) v.inner *= s[d];
  return v;
}

// out[o, k, i] = x[o, index[k], i]
template <typename U>
__global__ void index_select_kernel(const U* x, const int64_t* index, U* out, int64_t outer,
                                    int64_t x_size, int64_t k_size, int64_t inner) {
  const int64_t n = outer * k_size * inner;
  for (int64_t e = global_thread_id(); e < n; e += grid_stride()) {
    const int64_t i = e % inner, t = e / inner;
    const int64_t k = t % k_size, o = t / k_size;
    const int64_t idx = index[k];
    out[e] = (idx >= 0 && idx < x_size) ? x[(o * x_size + idx) * inner + i] : U(0);
  }
}

// out[o, index[k], i] += src[o, k, i]
template <typename T>
__global__ void index_add_kernel(T* out, const int64_t* index, const T* src, int64_t outer,
                                 int64_t out_size, int64_t k_size, int64_t inner) {
  const int64_t n = outer * k_size * inner;
  for (int64_t e = global_thread_id(); e < n; e += grid_stride()) {
    const int64_t i = e % inner, t = e / inner;
    const int64_t k = t % k_size, o = t / k_size;
    const int64_t idx = index[k];
    if (idx >= 0 && idx < out_size) atomic_add(&out[(o * out_size + idx) * inner + i], src[e]);
  }
}

// Note [Whole rows of 16 bytes]: an embedding's lookup and its gradient's
// add select whole rows (dim 0, outer 1) of a width that is a multiple of 16
// bytes. There a thread moves one 16-byte vector, its row and column from one
// 32-bit division, where the element kernels above take two 64-bit divisions
// an element: gpt2's token lookup ([16384] rows of 768 float32) took 92 us
// on an H200 (1.1 TB/s) and its gradient's add 78 us (benchmarks journal,
// session 42). The float sums use sm_90's 16-byte atomicAdd (four adds in
// one request; each lane's add is still atomic on its own, so the sums'
// order is as unfixed as before).
constexpr int64_t kRowVecBytes = 16;

// out[k, :] = x[index[k], :] in words W (uint4: 16 bytes), vecs words a row.
template <typename W>
__global__ void index_select_rows_kernel(const W* x, const int64_t* index, W* out, uint32_t vecs, int64_t x_size,
                                         uint32_t n) {
  for (uint32_t e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += gridDim.x * blockDim.x) {
    const uint32_t k = e / vecs, c = e - k * vecs;
    const int64_t idx = index[k];
    W v{};
    if (idx >= 0 && idx < x_size) v = x[idx * vecs + c];
    out[e] = v;
  }
}

// out[index[k], :] += src[k, :] for float32, four floats a request.
__global__ void index_add_rows_float4_kernel(float* out, const int64_t* index, const float* src, uint32_t vecs,
                                             int64_t out_size, uint32_t n) {
  for (uint32_t e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += gridDim.x * blockDim.x) {
    const uint32_t k = e / vecs, c = e - k * vecs;
    const int64_t idx = index[k];
    if (idx < 0 || idx >= out_size) continue;
    const float4 v = reinterpret_cast<const float4*>(src)[e];
    float4* p = reinterpret_cast<float4*>(out) + idx * vecs + c;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    atomicAdd(p, v);
#else
    atomicAdd(&p->x, v.x);
    atomicAdd(&p->y, v.y);
    atomicAdd(&p->z, v.z);
    atomicAdd(&p->w, v.w);
#endif
  }
}

// Offsets over the index shape: [0] out-or-src, [1] index, [2] the indexed tensor
// (stride 0 along dim; index * dim_stride is added).
template <typename U>
__global__ void gather_kernel(const U* x, const int64_t* index, U* out, int64_t n,
                              OffsetCalc<3> calc, int64_t x_size, int64_t x_dim_stride) {
  for (int64_t e = global_thread_id(); e < n; e += grid_stride()) {
    const Offsets<3> off = calc.get(e);
    const int64_t idx = index[off.v[1]];
    out[off.v[0]] = (idx >= 0 && idx < x_size) ? x[off.v[2] + idx * x_dim_stride] : U(0);
  }
}

template <typename T>
__global__ void scatter_add_kernel(T* out, const int64_t* index, const T* src, int64_t n,
                                   OffsetCalc<3> calc, int64_t out_size, int64_t out_dim_stride) {
  for (int64_t e = global_thread_id(); e < n; e += grid_stride()) {
    const Offsets<3> off = calc.get(e);
    const int64_t idx = index[off.v[1]];
    if (idx >= 0 && idx < out_size) atomic_add(&out[off.v[2] + idx * out_dim_stride], src[off.v[0]]);
  }
}

// ---- checks ------------------------------------------------------------------------------

int64_t wrap(const Tensor& t, int64_t dim, const char* op) {
  return wrap_dim(dim, std::max<int64_t>(t.dim(), 1), op);
}

void check_index_tensor(const Tensor& index, const Tensor& like, const char* op) {
  CHORUS_CHECK(index.dtype() == kInt64 && index.is_contiguous() && index.device() == like.device(),
               op, ": index must be a contiguous int64 tensor on ", like.device().str(), ", got ",
               index.describe());
}

void check_contiguous_same(const Tensor& a, const Tensor& b, const char* op) {
  CHORUS_CHECK(a.is_contiguous() && b.is_contiguous() && a.device() == b.device() &&
                   a.device().is_cuda() && a.dtype() == b.dtype(),
               op, ": expected contiguous CUDA tensors of one dtype on one device, got ",
               a.describe(), " and ", b.describe());
}

// For gather/scatter_add: `small` (the index's shape) fits in `big` except along dim.
void check_fits(const Tensor& index, const Tensor& big, int64_t dim, const char* op) {
  const Shape is = dims_of(index), bs = dims_of(big);
  CHORUS_CHECK(is.size() == bs.size(), op, ": index ", index.describe(), " and ", big.describe(),
               " differ in dims");
  for (size_t d = 0; d < is.size(); ++d) {
    CHORUS_CHECK(static_cast<int64_t>(d) == dim || is[d] <= bs[d], op, ": index ",
                 index.describe(), " is larger than ", big.describe(), " in dim ", d);
  }
}

// All three tensors are contiguous (checked), so their strides follow from their shapes.
OffsetCalc<3> index_shape_calc(const Tensor& index, const Tensor& same_shape, const Tensor& indexed,
                               int64_t dim) {
  Shape zeroed = contiguous_strides(dims_of(indexed));
  zeroed[static_cast<size_t>(dim)] = 0;
  const Shape shape = dims_of(index);
  return make_offset_calc<3>(shape, {contiguous_strides(dims_of(same_shape)),
                                     contiguous_strides(shape), zeroed});
}

// Whether t's first element sits on a multiple of `bytes`.
bool aligned_to(const Tensor& t, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(t.raw_data()) % static_cast<uintptr_t>(bytes) == 0;
}

int64_t dim_stride(const Tensor& t, int64_t dim) {
  return contiguous_strides(dims_of(t))[static_cast<size_t>(dim)];
}

}  // namespace

void index_select(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& out) {
  const char* op = "index_select";
  check_contiguous_same(x, out, op);
  dim = wrap(x, dim, op);
  check_index_tensor(index, x, op);
  const Dim3View xv = view_around(x, dim), ov = view_around(out, dim);
  CHORUS_CHECK(dims_of(out).size() == dims_of(x).size() && ov.outer == xv.outer && ov.inner == xv.inner &&
                   ov.size == index.numel(),
               op, ": output ", out.describe(), " does not match ", x.describe(), " with ",
               index.numel(), " indices along dim ", dim);
  const int64_t n = out.numel();
  if (n == 0) return;
  const int dev = out.device().index;
  CudaDeviceGuard guard(dev);
  const int64_t row_bytes = xv.inner * static_cast<int64_t>(dtype_size(x.dtype()));
  if (xv.outer == 1 && row_bytes % kRowVecBytes == 0 && aligned_to(x, kRowVecBytes) &&
      aligned_to(out, kRowVecBytes) && n * static_cast<int64_t>(dtype_size(x.dtype())) / kRowVecBytes < (int64_t{1} << 31)) {
    // Note [Whole rows of 16 bytes].
    const int64_t vecs = row_bytes / kRowVecBytes, total = ov.size * vecs;
    index_select_rows_kernel<uint4><<<grid_for(total), kThreads, 0, current_stream(dev)>>>(
        static_cast<const uint4*>(x.raw_data()), index.data<int64_t>(), static_cast<uint4*>(out.raw_data()),
        static_cast<uint32_t>(vecs), xv.size, static_cast<uint32_t>(total));
    CHORUS_CUDA_LAUNCH_CHECK();
    return;
  }
  dispatch_by_size(x.dtype(), [&]<typename U>() {
    index_select_kernel<U><<<grid_for(n), kThreads, 0, current_stream(dev)>>>(
        x.data<U>(), index.data<int64_t>(), out.data<U>(), xv.outer, xv.size, ov.size, xv.inner);
  });
  CHORUS_CUDA_LAUNCH_CHECK();
}

void index_add(const Tensor& out, int64_t dim, const Tensor& index, const Tensor& src) {
  const char* op = "index_add";
  check_contiguous_same(out, src, op);
  dim = wrap(out, dim, op);
  check_index_tensor(index, out, op);
  const Dim3View ov = view_around(out, dim), sv = view_around(src, dim);
  CHORUS_CHECK(dims_of(src).size() == dims_of(out).size() && sv.outer == ov.outer && sv.inner == ov.inner &&
                   sv.size == index.numel(),
               op, ": source ", src.describe(), " does not match ", out.describe(), " with ",
               index.numel(), " indices along dim ", dim);
  const int64_t n = src.numel();
  if (n == 0) return;
  const int dev = out.device().index;
  CudaDeviceGuard guard(dev);
  if (out.dtype() == kFloat32 && ov.outer == 1 && ov.inner % 4 == 0 && aligned_to(out, kRowVecBytes) &&
      aligned_to(src, kRowVecBytes) && n / 4 < (int64_t{1} << 31)) {
    // Note [Whole rows of 16 bytes].
    const int64_t vecs = ov.inner / 4, total = n / 4;
    index_add_rows_float4_kernel<<<grid_for(total), kThreads, 0, current_stream(dev)>>>(
        out.data<float>(), index.data<int64_t>(), src.data<float>(), static_cast<uint32_t>(vecs), ov.size,
        static_cast<uint32_t>(total));
    CHORUS_CUDA_LAUNCH_CHECK();
    return;
  }
  dispatch_all(out.dtype(), op, [&]<typename T>() {
    index_add_kernel<T><<<grid_for(n), kThreads, 0, current_stream(dev)>>>(
        out.data<T>(), index.data<int64_t>(), src.data<T>(), ov.outer, ov.size, sv.size, ov.inner);
  });
  CHORUS_CUDA_LAUNCH_CHECK();
}

void gather(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& out) {
  const char* op = "gather";
  check_contiguous_same(x, out, op);
  dim = wrap(x, dim, op);
  check_index_tensor(index, x, op);
  check_fits(index, x, dim, op);
  CHORUS_CHECK(dims_of(out) == dims_of(index), op, ": output ", out.describe(),
               " must have the index's shape ", shape_str(index.sizes()));
  const int64_t n = index.numel();
  if (n == 0) return;
  const OffsetCalc<3> calc = index_shape_calc(index, out, x, dim);
  const int dev = out.device().index;
  CudaDeviceGuard guard(dev);
  dispatch_by_size(x.dtype(), [&]<typename U>() {
    gather_kernel<U><<<grid_for(n), kThreads, 0, current_stream(dev)>>>(
        x.data<U>(), index.data<int64_t>(), out.data<U>(), n, calc, view_around(x, dim).size,
        dim_stride(x, dim));
  });
  CHORUS_CUDA_LAUNCH_CHECK();
}

void scatter_add(const Tensor& out, int64_t dim, const Tensor& index, const Tensor& src) {
  const char* op = "scatter_add";
  check_contiguous_same(out, src, op);
  dim = wrap(out, dim, op);
  check_index_tensor(index, out, op);
  check_fits(index, out, dim, op);
  check_fits(index, src, -1, op);
  const int64_t n = index.numel();
  if (n == 0) return;
  const OffsetCalc<3> calc = index_shape_calc(index, src, out, dim);
  const int dev = out.device().index;
  CudaDeviceGuard guard(dev);
  dispatch_all(out.dtype(), op, [&]<typename T>() {
    scatter_add_kernel<T><<<grid_for(n), kThreads, 0, current_stream(dev)>>>(
        out.data<T>(), index.data<int64_t>(), src.data<T>(), n, calc, view_around(out, dim).size,
        dim_stride(out, dim));
  });
  CHORUS_CUDA_LAUNCH_CHECK();
}

}  // namespace chorus::cuda
