// Layer norm's forward on CUDA, alone or beside the residual add (Note
// [Residual add beside layer norm] in ops/transformer.h): from registers for
// rows that fit (Note [Layer norm's forward from registers]), else a loop
// over the row. The backward is layer_norm_backward.cu; the helpers both
// share, layer_norm.cuh.
#include "chorus/cuda/kernels/layer_norm.cuh"

namespace chorus::cuda {

namespace {

// The loop kernels' second and third passes over a row of nv = cols / V
// vectors whose sum is `sum` (already reduced over the row's threads): the
// variance of the centred values (a second read, from cache), then y, and
// the row's mean and rstd.
template <typename T, typename G, int V>
__device__ __forceinline__ void normalize_row(const Vec<T, V>* vr, float sum, const G* gamma, const G* beta,
                                              float eps, T* y, float* mean, float* rstd, int64_t row, int64_t cols) {
  const int64_t nv = cols / V;
  const float m = sum / static_cast<float>(cols);
  SumV var{0.0f};
  for (int64_t c = threadIdx.x; c < nv; c += blockDim.x) {
    const Vec<T, V> v = vr[c];
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
    const Vec<T, V> v = vr[c];
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

// V elements per 16-byte access of x, y, dy and dx; the parameters are read
// element by element (the same few KB for every row: from L1). The forward
// kernels here loop over a row of any length; rows that fit in a warp's
// registers take layer_norm_forward_reg_kernel instead (Note [Layer norm's
// forward from registers]).
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
  normalize_row<T, G, V>(xr, row_allreduce(s).s, gamma, beta, eps, y, mean, rstd, row, cols);
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
  normalize_row<T, G, V>(sr, row_allreduce(s).s, gamma, beta, eps, y, mean, rstd, row, cols);
}

// Note [Layer norm's forward from registers]: a row of up to kRegMaxK * 32
// vectors (768 bf16: 96 vectors, K = 3 a lane; gpt2-xl's 1600: 200, the K = 8
// instance with its last vectors masked) is read once into the registers of
// its warp, lane l holding vectors l + 32 k, k < K. Every load of x (and r)
// is issued before the first store and before the first shuffle, so a warp
// has its whole row in flight at once; the mean and the variance are summed
// from the registers, and sum and y are written once. The loop kernels above
// (layer_norm_forward_kernel, add_layer_norm_forward_kernel) read the row
// two or three times instead, from cache, a runtime-bounded loop at a time,
// and the add's stores of sum sat between its loads and those that followed
// them: the compiler may not move a load of x past a store through a pointer
// that could alias it. They reach about 2.3 TB/s of an H200's 4 on GPT-2's
// [16384, 768] bf16 (a CUPTI trace: 42.5 us a call with the add), and remain
// for longer rows and for rows that are not whole 16-byte vectors past
// kRegMaxK * 32 elements.
//
// Same numerics as the loop kernels where their layout is the same (rows of
// up to kWarpCols, a warp each): each lane sums its vectors in the same
// order, the mean and the variance are of the sum as rounded to T (Note
// [Residual add beside layer norm]), the same row_allreduce, the same
// expressions, so the outputs are bit for bit theirs. Rows of kWarpCols to
// kRegMaxK * 32 * V columns (16-bit rows of 1025 to 2048) move from a block
// to a warp, which changes the order of the row's float sums (rounding only).
//
// One row a warp, kRowsPerBlock warps a block, no more: a warp's row is
// already all in flight (K = 3 with the add: six 16-byte loads a lane, 3 KB
// a warp), and the latency is hidden by the other warps of the SM, which the
// registers allow: ptxas (CUDA 13, sm_90) gives the K = 3 instances 47 to 56
// a thread (four blocks of 256 an SM, 32 warps: up to 100 KB in flight), the
// K = 8 ones up to 96 (two blocks), without spills. Two rows a warp would only
// trade those warps for registers. gamma and beta are read as 16-byte vectors
// (the same few KB for every row: from L1) after the reductions, so that
// their registers are not held across the row's loads.
constexpr int kRegMaxK = 8;

// The register kernels' __launch_bounds__ minimum of resident blocks: at most
// 64 registers a thread up to K = 4, 128 at K = 8. Left free, ptxas settles
// on 48 for some K = 3 instances and spills a few bytes to get there.
constexpr int reg_min_blocks(int k) { return k <= 4 ? 4 : 2; }

// The second half of both register kernels: given lane's K vectors v of the
// row (of the sum, with the add) and their sum s (this lane's), all-reduces
// the mean and the variance and writes y, mean and rstd.
template <int K, typename T, typename G, int V>
__device__ __forceinline__ void layer_norm_reg_finish(const Vec<T, V> (&v)[K], SumV s, const G* __restrict__ gamma,
                                                      const G* __restrict__ beta, float eps, T* __restrict__ y,
                                                      float* __restrict__ mean, float* __restrict__ rstd,
                                                      int64_t row, int nv, int64_t cols) {
  s = row_allreduce(s);
  const float m = s.s / static_cast<float>(cols);
  SumV var{0.0f};
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (static_cast<int>(threadIdx.x) + k * 32 < nv) {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float d = to_acc(v[k].v[j]) - m;
        var.s += d * d;
      }
    }
  }
  var = row_allreduce(var);
  const float rs = rsqrtf(var.s / static_cast<float>(cols) + eps);
  Vec<T, V>* yr = reinterpret_cast<Vec<T, V>*>(y + row * cols);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int c = threadIdx.x + k * 32;
    if (c < nv) {
      float g[V], b[V];
      load_params<G, V>(gamma, c * V, 1.0f, g);
      load_params<G, V>(beta, c * V, 0.0f, b);
      Vec<T, V> out;
#pragma unroll
      for (int j = 0; j < V; ++j) out.v[j] = convert<T>((to_acc(v[k].v[j]) - m) * rs * g[j] + b[j]);
      yr[c] = out;
    }
  }
  if (threadIdx.x == 0) {
    mean[row] = m;
    rstd[row] = rs;
  }
}

// layer_norm_forward_kernel for rows of at most K * 32 vectors, a warp each
// (blockDim (32, kRowsPerBlock)).
template <int K, typename T, typename G, int V>
__global__ void __launch_bounds__(32 * kRowsPerBlock, reg_min_blocks(K))
    layer_norm_forward_reg_kernel(const T* __restrict__ x, const G* __restrict__ gamma, const G* __restrict__ beta,
                                  float eps, T* __restrict__ y, float* __restrict__ mean, float* __restrict__ rstd,
                                  int64_t rows, int64_t cols) {
  const int64_t row = row_index();
  if (row >= rows) return;  // the same for the whole warp
  const int nv = static_cast<int>(cols / V);  // at most kRegMaxK * 32
  const Vec<T, V>* xr = reinterpret_cast<const Vec<T, V>*>(x + row * cols);
  Vec<T, V> v[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int c = threadIdx.x + k * 32;
    if (c < nv) v[k] = xr[c];
  }
  SumV s{0.0f};
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if (static_cast<int>(threadIdx.x) + k * 32 < nv) {
#pragma unroll
      for (int j = 0; j < V; ++j) s.s += to_acc(v[k].v[j]);
    }
  }
  layer_norm_reg_finish<K>(v, s, gamma, beta, eps, y, mean, rstd, row, nv, cols);
}

// add_layer_norm_forward_kernel for rows of at most K * 32 vectors, a warp
// each: sum = x + r rounded to T stays in registers for the norm.
template <int K, typename T, typename G, int V>
__global__ void __launch_bounds__(32 * kRowsPerBlock, reg_min_blocks(K))
    add_layer_norm_forward_reg_kernel(const T* __restrict__ x, const T* __restrict__ r, const G* __restrict__ gamma,
                                      const G* __restrict__ beta, float eps, T* __restrict__ sum, T* __restrict__ y,
                                      float* __restrict__ mean, float* __restrict__ rstd, int64_t rows,
                                      int64_t cols) {
  const int64_t row = row_index();
  if (row >= rows) return;  // the same for the whole warp
  const int nv = static_cast<int>(cols / V);  // at most kRegMaxK * 32
  const Vec<T, V>* xr = reinterpret_cast<const Vec<T, V>*>(x + row * cols);
  const Vec<T, V>* rr = reinterpret_cast<const Vec<T, V>*>(r + row * cols);
  Vec<T, V> a[K], b[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int c = threadIdx.x + k * 32;
    if (c < nv) {
      a[k] = xr[c];
      b[k] = rr[c];
    }
  }
  Vec<T, V>* sr = reinterpret_cast<Vec<T, V>*>(sum + row * cols);
  Vec<T, V> v[K];
  SumV s{0.0f};
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int c = threadIdx.x + k * 32;
    if (c < nv) {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        v[k].v[j] = convert<T>(to_acc(a[k].v[j]) + to_acc(b[k].v[j]));
        s.s += to_acc(v[k].v[j]);
      }
      sr[c] = v[k];
    }
  }
  layer_norm_reg_finish<K>(v, s, gamma, beta, eps, y, mean, rstd, row, nv, cols);
}

// Runs f.template operator()<K>() with the register kernels' K for rows of nv
// vectors (the fewest of 1, 2, 3, 4, 8 with 32 K >= nv); false where nv is
// past kRegMaxK * 32 (the loop kernels' rows).
template <typename F>
bool with_reg_k(int64_t nv, F&& f) {
  const int64_t per_lane = (nv + 31) / 32;
  if (per_lane <= 1) return f.template operator()<1>(), true;
  if (per_lane <= 2) return f.template operator()<2>(), true;
  if (per_lane <= 3) return f.template operator()<3>(), true;
  if (per_lane <= 4) return f.template operator()<4>(), true;
  if (per_lane <= kRegMaxK) return f.template operator()<kRegMaxK>(), true;
  return false;
}

inline dim3 reg_grid(int64_t rows) {
  return dim3(static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock));
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
  cudaStream_t stream = current_stream(dev);
  dispatch_float(x.dtype(), op, [&]<typename T>() {
    with_param_type<T>(gamma, beta, x.dtype(), op, [&]<typename G>() {
      with_row_vector<T>(cols, {x.raw_data(), y.raw_data(), param_ptr<G>(gamma), param_ptr<G>(beta)}, [&]<int V>() {
        // Note [Layer norm's forward from registers].
        const bool reg = with_reg_k(cols / V, [&]<int K>() {
          layer_norm_forward_reg_kernel<K, T, G, V><<<reg_grid(rows), dim3(32, kRowsPerBlock), 0, stream>>>(
              x.data<T>(), param_ptr<G>(gamma), param_ptr<G>(beta), static_cast<float>(eps), y.data<T>(),
              mean.data<float>(), rstd.data<float>(), rows, cols);
        });
        if (reg) return;
        const RowLaunch l = row_launch(rows, cols);
        layer_norm_forward_kernel<T, G, V><<<l.grid, l.block, 0, stream>>>(
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
  cudaStream_t stream = current_stream(dev);
  dispatch_float(x.dtype(), op, [&]<typename T>() {
    with_param_type<T>(gamma, beta, x.dtype(), op, [&]<typename G>() {
      const std::initializer_list<const void*> ptrs{
          x.raw_data(), r.raw_data(), sum.raw_data(), y.raw_data(), param_ptr<G>(gamma), param_ptr<G>(beta)};
      with_row_vector<T>(cols, ptrs, [&]<int V>() {
        // Note [Layer norm's forward from registers].
        const bool reg = with_reg_k(cols / V, [&]<int K>() {
          add_layer_norm_forward_reg_kernel<K, T, G, V><<<reg_grid(rows), dim3(32, kRowsPerBlock), 0, stream>>>(
              x.data<T>(), r.data<T>(), param_ptr<G>(gamma), param_ptr<G>(beta), static_cast<float>(eps),
              sum.data<T>(), y.data<T>(), mean.data<float>(), rstd.data<float>(), rows, cols);
        });
        if (reg) return;
        const RowLaunch l = row_launch(rows, cols);
        add_layer_norm_forward_kernel<T, G, V><<<l.grid, l.block, 0, stream>>>(
            x.data<T>(), r.data<T>(), param_ptr<G>(gamma), param_ptr<G>(beta), static_cast<float>(eps),
            sum.data<T>(), y.data<T>(), mean.data<float>(), rstd.data<float>(), rows, cols);
      });
    });
  });
  CHORUS_CUDA_LAUNCH_CHECK();
}

}  // namespace chorus::cuda
