// Elementwise kernels of the CUDA kernel set: unary, binary, copy, fill.
//
// One launcher serves them all: out[i] = op(in0[i], in1[i]) over strided
// operands. When every operand is contiguous it runs a vectorised kernel
// (16-byte loads and stores where the pointers are aligned); otherwise a
// strided kernel maps each linear index to per-operand offsets (tensor_iter.cuh).
// The op is chosen at run time inside the functor (a uniform branch), which
// keeps the number of kernel instantiations, and the compile time, small.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "chorus/cuda/runtime/context.h"
#include "chorus/cuda/kernels/dtype_dispatch.cuh"
#include "chorus/cuda/kernels/kernels.h"
#include "chorus/cuda/kernels/tensor_iter.cuh"

namespace chorus::cuda {

namespace {

template <typename In, int NIN>
struct Inputs {
  const In* p[NIN > 0 ? NIN : 1];
};

template <int NIN, typename Op, typename In>
__device__ __forceinline__ auto apply(const Op& op, const In* x) {
  if constexpr (NIN == 0) return op();
  else if constexpr (NIN == 1) return op(x[0]);
  else return op(x[0], x[1]);
}

// op over V elements of each input at once (both vectorised kernels).
template <int V, typename Out, int NIN, typename In, typename Op>
__device__ __forceinline__ Vec<Out, V> apply_vec(const Op& op, const Vec<In, V>* x) {
  Vec<Out, V> y;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    In e[NIN > 0 ? NIN : 1];
#pragma unroll
    for (int k = 0; k < NIN; ++k) e[k] = x[k].v[j];
    y.v[j] = apply<NIN>(op, e);
  }
  return y;
}

template <int V, typename Out, typename In, int NIN, typename Op>
__global__ void contiguous_kernel(int64_t n, Out* out, Inputs<In, NIN> in, Op op) {
  const int64_t tid = global_thread_id(), stride = grid_stride();
  const int64_t nvec = n / V;
  for (int64_t i = tid; i < nvec; i += stride) {
    Vec<In, V> x[NIN > 0 ? NIN : 1];
#pragma unroll
    for (int k = 0; k < NIN; ++k) x[k] = reinterpret_cast<const Vec<In, V>*>(in.p[k])[i];
    reinterpret_cast<Vec<Out, V>*>(out)[i] = apply_vec<V, Out, NIN>(op, x);
  }
  for (int64_t i = nvec * V + tid; i < n; i += stride) {
    In e[NIN > 0 ? NIN : 1];
#pragma unroll
    for (int k = 0; k < NIN; ++k) e[k] = in.p[k][i];
    out[i] = apply<NIN>(op, e);
  }
}

// Note [Rows of contiguous elements]: a strided walk whose innermost dim is
// contiguous in every operand (a permuted copy such as attention's heads
// [B, T, H, D] -> [B, H, T, D], a bias broadcast over rows) moves V elements
// per offset computation and per 16-byte access instead of one: the generic
// strided kernel, an offset per element and 2-byte accesses, was the largest
// cost of a GPT-2 step in exactly these two shapes (benchmarks journal,
// session 31's GPT profile).
// Inputs whose bit is set in `repeat` are broadcast along the innermost dim
// (stride 0 there): one element stands for all V.
template <int V, typename Out, typename In, int NIN, typename Op>
__global__ void inner_vector_kernel(int64_t nvec, Out* out, Inputs<In, NIN> in, OffsetCalc<NIN + 1> calc,
                                    uint32_t repeat, Op op) {
  for (int64_t i = global_thread_id(); i < nvec; i += grid_stride()) {
    const Offsets<NIN + 1> off = calc.get(i * V);
    Vec<In, V> x[NIN > 0 ? NIN : 1];
#pragma unroll
    for (int k = 0; k < NIN; ++k) {
      if (repeat & (1u << k)) {
        const In e = in.p[k][off.v[k + 1]];
#pragma unroll
        for (int j = 0; j < V; ++j) x[k].v[j] = e;
      } else {
        x[k] = *reinterpret_cast<const Vec<In, V>*>(in.p[k] + off.v[k + 1]);
      }
    }
    *reinterpret_cast<Vec<Out, V>*>(out + off.v[0]) = apply_vec<V, Out, NIN>(op, x);
  }
}

template <typename Out, typename In, int NIN, typename Op>
__global__ void strided_kernel(int64_t n, Out* out, Inputs<In, NIN> in, OffsetCalc<NIN + 1> calc,
                               Op op) {
  for (int64_t i = global_thread_id(); i < n; i += grid_stride()) {
    const Offsets<NIN + 1> off = calc.get(i);
    In e[NIN > 0 ? NIN : 1];
#pragma unroll
    for (int k = 0; k < NIN; ++k) e[k] = in.p[k][off.v[k + 1]];
    out[off.v[0]] = apply<NIN>(op, e);
  }
}

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// out = op(ins...) elementwise; every tensor has out's shape (strides may be 0).
template <typename Out, typename In, int NIN, typename Op>
void launch_elementwise(const Tensor& out, std::array<const Tensor*, NIN> ins, const Op& op) {
  const int64_t n = out.numel();
  if (n == 0) return;
  const int dev = out.device().index;
  CudaDeviceGuard guard(dev);
  cudaStream_t stream = current_stream(dev);

  // Note [Elementwise dims in the output's memory order]: the dims are walked
  // in the order of the output's strides (largest first), not in the logical
  // order, as PyTorch's TensorIterator does: operands of one dense layout
  // other than row-major (channels-last weights and activations) then merge
  // into one dim and take the vectorised contiguous kernel, and a layout
  // change writes the output in order. Walked logically, an NHWC copy read and
  // wrote with a stride of C elements: the float32 weight gradients converted
  // from cuDNN's bf16 ones (Note [Float filter gradients from 16-bit data] in
  // conv.cpp) were a visible share of a WRN-28-10 step's kernel time on an
  // H100, and in memory order the graphed bf16 step ran faster (benchmarks
  // journal, session 29).
  // No op here depends on the walk's order.
  const size_t nd = out.sizes().size();
  std::array<size_t, kMaxDims> order{};
  for (size_t d = 0; d < nd && d < kMaxDims; ++d) order[d] = d;
  if (nd <= static_cast<size_t>(kMaxDims))
    std::stable_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(nd), [&](size_t a, size_t b) {
      return out.stride(static_cast<int64_t>(a)) > out.stride(static_cast<int64_t>(b));
    });
  auto permuted = [&](const Shape& v) {
    if (nd > static_cast<size_t>(kMaxDims)) return v;  // make_offset_calc names the limit
    Shape p(nd);
    for (size_t d = 0; d < nd; ++d) p[d] = v[order[d]];
    return p;
  };
  std::array<Shape, NIN + 1> strides;
  strides[0] = permuted(out.strides());
  Inputs<In, NIN> in{};
  for (int k = 0; k < NIN; ++k) {
    strides[static_cast<size_t>(k) + 1] = permuted(ins[static_cast<size_t>(k)]->strides());
    in.p[k] = static_cast<const In*>(ins[static_cast<size_t>(k)]->raw_data());
  }
  const OffsetCalc<NIN + 1> calc = make_offset_calc<NIN + 1>(permuted(out.sizes()), strides);
  Out* o = static_cast<Out*>(out.raw_data());

  if (calc.contiguous()) {
    constexpr size_t kWidest = std::max(sizeof(Out), NIN > 0 ? sizeof(In) : size_t{1});
    constexpr int V = static_cast<int>(std::min<size_t>(8, 16 / kWidest));
    bool vec = V > 1 && aligned(o, V * sizeof(Out));
    for (int k = 0; k < NIN; ++k) vec = vec && aligned(in.p[k], V * sizeof(In));
    if (vec) {
      contiguous_kernel<V, Out, In, NIN><<<grid_for(n / V + 1), kThreads, 0, stream>>>(n, o, in, op);
    } else {
      contiguous_kernel<1, Out, In, NIN><<<grid_for(n), kThreads, 0, stream>>>(n, o, in, op);
    }
  } else {
    // Note [Rows of contiguous elements].
    constexpr size_t kWidest = std::max(sizeof(Out), NIN > 0 ? sizeof(In) : size_t{1});
    constexpr int V = static_cast<int>(std::min<size_t>(8, 16 / kWidest));
    bool rows = V > 1 && calc.ndim >= 1 && calc.sizes[0] % V == 0 && aligned(o, V * sizeof(Out));
    uint32_t repeat = 0;
    for (int k = 0; k < NIN + 1 && rows; ++k) {
      if (k > 0 && calc.strides[0][k] == 0) {  // an input repeated along the rows: read once per V
        repeat |= 1u << (k - 1);
        continue;
      }
      rows = calc.strides[0][k] == 1;
      for (int d = 1; d < calc.ndim && rows; ++d) rows = calc.strides[d][k] % V == 0;
      if (k > 0) rows = rows && aligned(in.p[k - 1], V * sizeof(In));
    }
    if (rows) {
      inner_vector_kernel<V, Out, In, NIN>
          <<<grid_for(n / V), kThreads, 0, stream>>>(n / V, o, in, calc, repeat, op);
    } else {
      strided_kernel<Out, In, NIN><<<grid_for(n), kThreads, 0, stream>>>(n, o, in, calc, op);
    }
  }
  CHORUS_CUDA_LAUNCH_CHECK();
}

// ---- unary ------------------------------------------------------------------------
// The math matches cpu/elementwise.cpp op for op (including NaN behaviour:
// relu, sign, max and min do not propagate NaN there either), computed in
// acc_t<T>: float for floating dtypes, double for integers.

template <typename C>
__device__ __forceinline__ C unary_math(UnaryOp op, C x, C s) {
  constexpr bool f = std::is_same_v<C, float>;
  switch (op) {
    case UnaryOp::Neg: return -x;
    case UnaryOp::Exp: if constexpr (f) return expf(x); else return exp(x);
    case UnaryOp::Log: if constexpr (f) return logf(x); else return log(x);
    case UnaryOp::Sqrt: if constexpr (f) return sqrtf(x); else return sqrt(x);
    case UnaryOp::Rsqrt: if constexpr (f) return 1.0f / sqrtf(x); else return 1.0 / sqrt(x);
    case UnaryOp::Tanh: if constexpr (f) return tanhf(x); else return tanh(x);
    case UnaryOp::Sigmoid:
      if constexpr (f) return 1.0f / (1.0f + expf(-x)); else return 1.0 / (1.0 + exp(-x));
    case UnaryOp::Relu: return x > C(0) ? x : C(0);
    case UnaryOp::Abs: if constexpr (f) return fabsf(x); else return fabs(x);
    case UnaryOp::Square: return x * x;
    case UnaryOp::Reciprocal: return C(1) / x;
    case UnaryOp::Sign: return C((x > C(0)) - (x < C(0)));
    case UnaryOp::Pow: if constexpr (f) return powf(x, s); else return pow(x, s);
    case UnaryOp::AddScalar: return x + s;
    case UnaryOp::MulScalar: return x * s;
    case UnaryOp::RSubScalar: return s - x;
    case UnaryOp::Gelu:
      if constexpr (f) return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
      else return 0.5 * x * (1.0 + erf(x * 0.70710678118654752));
    case UnaryOp::GeluTanh: {
      const C k = C(0.7978845608028654);
      if constexpr (f) return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
      else return 0.5 * x * (1.0 + tanh(k * (x + 0.044715 * x * x * x)));
    }
    default: return x;
  }
}

template <typename T>
struct UnaryFn {
  UnaryOp op;
  acc_t<T> scalar;
  __device__ __forceinline__ T operator()(T x) const {
    return convert<T>(unary_math(op, to_acc(x), scalar));
  }
};

template <typename T>
struct GtScalarFn {
  acc_t<T> scalar;
  __device__ __forceinline__ bool operator()(T x) const { return to_acc(x) > scalar; }
};

// ---- binary -----------------------------------------------------------------------

template <typename T>
struct BinaryFn {
  BinaryOp op;
  acc_t<T> alpha;
  __device__ __forceinline__ T operator()(T a, T b) const {
    using C = acc_t<T>;
    const C x = to_acc(a), y = to_acc(b);
    C r;
    switch (op) {
      case BinaryOp::Add: r = x + alpha * y; break;
      case BinaryOp::Sub: r = x - alpha * y; break;
      case BinaryOp::Mul: r = x * y; break;
      case BinaryOp::Div: r = x / y; break;  // integers: in double, truncated on store
      case BinaryOp::Max: r = x > y ? x : y; break;
      case BinaryOp::Min: r = x < y ? x : y; break;
      case BinaryOp::ReluGrad: r = y > C(0) ? x : C(0); break;
      case BinaryOp::TanhGrad: r = x * (C(1) - y * y); break;
      case BinaryOp::SigmoidGrad: r = x * y * (C(1) - y); break;
      case BinaryOp::GeluGrad: {
        const C cdf = C(0.5) * (C(1) + erf(y * C(0.70710678118654752)));
        const C pdf = exp(C(-0.5) * y * y) * C(0.3989422804014327);
        r = x * (cdf + y * pdf);
        break;
      }
      case BinaryOp::GeluTanhGrad: {
        const C k = C(0.7978845608028654);
        const C t = tanh(k * (y + C(0.044715) * y * y * y));
        r = x * (C(0.5) * (C(1) + t) + C(0.5) * y * (C(1) - t * t) * k * (C(1) + C(3 * 0.044715) * y * y));
        break;
      }
      default: r = x; break;
    }
    return convert<T>(r);
  }
};

template <typename T>
struct CompareFn {
  BinaryOp op;
  __device__ __forceinline__ bool operator()(T a, T b) const {
    const acc_t<T> x = to_acc(a), y = to_acc(b);
    switch (op) {
      case BinaryOp::Eq: return x == y;
      case BinaryOp::Ne: return x != y;
      case BinaryOp::Lt: return x < y;
      case BinaryOp::Le: return x <= y;
      case BinaryOp::Gt: return x > y;
      default: return x >= y;
    }
  }
};

// ---- copy / fill -------------------------------------------------------------------

template <typename Out, typename In>
struct ConvertFn {
  __device__ __forceinline__ Out operator()(In x) const { return convert<Out>(x); }
};

template <typename T>
struct ConstantFn {
  T value;
  __device__ __forceinline__ T operator()() const { return value; }
};

template <typename T>
using same_size_uint =
    std::conditional_t<sizeof(T) == 1, uint8_t,
                       std::conditional_t<sizeof(T) == 2, uint16_t,
                                          std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>>>;

void check_same_device(const Tensor& a, const Tensor& b, const char* op) {
  CHORUS_CHECK(a.device() == b.device() && a.device().is_cuda(), op,
               ": tensors must be on one CUDA device, got ", a.describe(), " and ", b.describe());
}

void check_same_shape(const Tensor& a, const Tensor& b, const char* op) {
  CHORUS_CHECK(a.sizes() == b.sizes(), op, ": shapes differ: ", a.describe(), " and ",
               b.describe());
}

}  // namespace

void unary(UnaryOp op, const Tensor& x, const Tensor& out, double scalar) {
  check_same_device(x, out, "unary");
  check_same_shape(x, out, "unary");
  if (op == UnaryOp::GtScalar) {
    CHORUS_CHECK(out.dtype() == kBool, "unary GtScalar: output must be bool, got ", out.describe());
    dispatch_all(x.dtype(), "unary", [&]<typename T>() {
      launch_elementwise<bool, T, 1>(out, {&x}, GtScalarFn<T>{static_cast<acc_t<T>>(scalar)});
    });
    return;
  }
  CHORUS_CHECK(out.dtype() == x.dtype(), "unary: output dtype ", out.dtype(), " differs from ",
               x.dtype());
  dispatch_all(x.dtype(), "unary", [&]<typename T>() {
    launch_elementwise<T, T, 1>(out, {&x}, UnaryFn<T>{op, static_cast<acc_t<T>>(scalar)});
  });
}

void binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out, double alpha) {
  check_same_device(a, out, "binary");
  check_same_device(b, out, "binary");
  check_same_shape(a, out, "binary");
  check_same_shape(b, out, "binary");
  CHORUS_CHECK(a.dtype() == b.dtype(), "binary: operand dtypes differ: ", a.describe(), " and ",
               b.describe());
  if (is_comparison(op)) {
    CHORUS_CHECK(out.dtype() == kBool, "binary comparison: output must be bool, got ",
                 out.describe());
    dispatch_all(a.dtype(), "binary", [&]<typename T>() {
      launch_elementwise<bool, T, 2>(out, {&a, &b}, CompareFn<T>{op});
    });
    return;
  }
  CHORUS_CHECK(out.dtype() == a.dtype(), "binary: output dtype ", out.dtype(), " differs from ",
               a.dtype());
  dispatch_all(a.dtype(), "binary", [&]<typename T>() {
    launch_elementwise<T, T, 2>(out, {&a, &b},
                                BinaryFn<T>{op, static_cast<acc_t<T>>(alpha)});
  });
}

void copy(const Tensor& src, const Tensor& dst) {
  check_same_device(src, dst, "copy");
  check_same_shape(src, dst, "copy");
  if (dst.numel() == 0) return;
  if (src.dtype() == dst.dtype()) {
    if (src.is_contiguous() && dst.is_contiguous()) {
      if (src.raw_data() == dst.raw_data()) return;
      const int dev = dst.device().index;
      CudaDeviceGuard guard(dev);
      CHORUS_CUDA_CHECK(cudaMemcpyAsync(dst.raw_data(), src.raw_data(), dst.nbytes(),
                                        cudaMemcpyDeviceToDevice, current_stream(dev)));
      return;
    }
    dispatch_by_size(dst.dtype(), [&]<typename U>() {
      launch_elementwise<U, U, 1>(dst, {&src}, ConvertFn<U, U>{});
    });
    return;
  }
  dispatch_all(src.dtype(), "copy", [&]<typename In>() {
    dispatch_all(dst.dtype(), "copy", [&]<typename Out>() {
      if constexpr (!std::is_same_v<In, Out>) {
        launch_elementwise<Out, In, 1>(dst, {&src}, ConvertFn<Out, In>{});
      }
    });
  });
}

void fill(const Tensor& out, double value) {
  CHORUS_CHECK(out.device().is_cuda(), "fill: expected a CUDA tensor, got ", out.describe());
  dispatch_all(out.dtype(), "fill", [&]<typename T>() {
    // Store the bits of the converted value, so 16-bit floats need no device ctor.
    using U = same_size_uint<T>;
    const T v = convert<T>(value);
    U bits;
    static_assert(sizeof(U) == sizeof(T));
    std::memcpy(&bits, &v, sizeof(T));
    launch_elementwise<U, U, 0>(out, {}, ConstantFn<U>{bits});
  });
}

}  // namespace chorus::cuda
