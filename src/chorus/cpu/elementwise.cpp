// CPU elementwise kernels of the kernel set: unary, binary, copy, copy_multi,
// fill.
#include <cmath>
#include <cstring>
#include <type_traits>

#include "chorus/core/error.h"
#include "chorus/cpu/dtype_dispatch.h"
#include "chorus/cpu/kernels.h"
#include "chorus/cpu/strided_loop.h"

namespace chorus::cpu {

namespace {

template <typename C>
inline C apply_unary(UnaryOp op, C x, C s) {
  switch (op) {
    case UnaryOp::Neg: return -x;
    case UnaryOp::Exp: return std::exp(x);
    case UnaryOp::Log: return std::log(x);
    case UnaryOp::Sqrt: return std::sqrt(x);
    case UnaryOp::Rsqrt: return C(1) / std::sqrt(x);
    case UnaryOp::Tanh: return std::tanh(x);
    case UnaryOp::Sigmoid: return C(1) / (C(1) + std::exp(-x));
    case UnaryOp::Relu: return x > C(0) ? x : C(0);
    case UnaryOp::Abs: return std::abs(x);
    case UnaryOp::Square: return x * x;
    case UnaryOp::Reciprocal: return C(1) / x;
    case UnaryOp::Sign: return C((x > C(0)) - (x < C(0)));
    case UnaryOp::Pow: return std::pow(x, s);
    case UnaryOp::AddScalar: return x + s;
    case UnaryOp::MulScalar: return x * s;
    case UnaryOp::RSubScalar: return s - x;
    case UnaryOp::GtScalar: return C(x > s);
    case UnaryOp::Gelu: return C(0.5) * x * (C(1) + std::erf(x * C(M_SQRT1_2)));
    case UnaryOp::GeluTanh: {
      const C k = C(0.7978845608028654);  // sqrt(2 / pi)
      return C(0.5) * x * (C(1) + std::tanh(k * (x + C(0.044715) * x * x * x)));
    }
  }
  return x;
}

template <typename C>
inline C apply_binary(BinaryOp op, C a, C b, C alpha) {
  switch (op) {
    case BinaryOp::Add: return a + alpha * b;
    case BinaryOp::Sub: return a - alpha * b;
    case BinaryOp::Mul: return a * b;
    case BinaryOp::Div: return a / b;
    case BinaryOp::Max: return a > b ? a : b;
    case BinaryOp::Min: return a < b ? a : b;
    case BinaryOp::Eq: return C(a == b);
    case BinaryOp::Ne: return C(a != b);
    case BinaryOp::Lt: return C(a < b);
    case BinaryOp::Le: return C(a <= b);
    case BinaryOp::Gt: return C(a > b);
    case BinaryOp::Ge: return C(a >= b);
    case BinaryOp::ReluGrad: return b > C(0) ? a : C(0);
    case BinaryOp::TanhGrad: return a * (C(1) - b * b);
    case BinaryOp::SigmoidGrad: return a * b * (C(1) - b);
    case BinaryOp::GeluGrad: {
      const C cdf = C(0.5) * (C(1) + std::erf(b * C(M_SQRT1_2)));
      const C pdf = std::exp(C(-0.5) * b * b) * C(0.3989422804014327);  // 1 / sqrt(2 pi)
      return a * (cdf + b * pdf);
    }
    case BinaryOp::GeluTanhGrad: {
      const C k = C(0.7978845608028654);
      const C t = std::tanh(k * (b + C(0.044715) * b * b * b));
      return a * (C(0.5) * (C(1) + t) + C(0.5) * b * (C(1) - t * t) * k * (C(1) + C(3 * 0.044715) * b * b));
    }
  }
  return a;
}

// Calls fn(std::integral_constant<Op, op>{}): inside fn the op is a
// compile-time constant, so apply_unary / apply_binary fold to one
// expression and a contiguous loop over it vectorises (with the op read per
// element, the CNN's ReLU and its gradient took a fifth of a CPU step).
template <typename F>
inline void with_unary_op(UnaryOp op, F&& fn) {
  using U = UnaryOp;
  switch (op) {
#define CHORUS_UNARY_CASE(o) \
  case U::o: return fn(std::integral_constant<U, U::o>{});
    CHORUS_UNARY_CASE(Neg) CHORUS_UNARY_CASE(Exp) CHORUS_UNARY_CASE(Log) CHORUS_UNARY_CASE(Sqrt)
    CHORUS_UNARY_CASE(Rsqrt) CHORUS_UNARY_CASE(Tanh) CHORUS_UNARY_CASE(Sigmoid) CHORUS_UNARY_CASE(Relu)
    CHORUS_UNARY_CASE(Abs) CHORUS_UNARY_CASE(Square) CHORUS_UNARY_CASE(Reciprocal) CHORUS_UNARY_CASE(Sign)
    CHORUS_UNARY_CASE(Pow) CHORUS_UNARY_CASE(AddScalar) CHORUS_UNARY_CASE(MulScalar)
    CHORUS_UNARY_CASE(RSubScalar) CHORUS_UNARY_CASE(GtScalar) CHORUS_UNARY_CASE(Gelu) CHORUS_UNARY_CASE(GeluTanh)
#undef CHORUS_UNARY_CASE
  }
}

template <typename F>
inline void with_binary_op(BinaryOp op, F&& fn) {
  using B = BinaryOp;
  switch (op) {
#define CHORUS_BINARY_CASE(o) \
  case B::o: return fn(std::integral_constant<B, B::o>{});
    CHORUS_BINARY_CASE(Add) CHORUS_BINARY_CASE(Sub) CHORUS_BINARY_CASE(Mul) CHORUS_BINARY_CASE(Div)
    CHORUS_BINARY_CASE(Max) CHORUS_BINARY_CASE(Min) CHORUS_BINARY_CASE(Eq) CHORUS_BINARY_CASE(Ne)
    CHORUS_BINARY_CASE(Lt) CHORUS_BINARY_CASE(Le) CHORUS_BINARY_CASE(Gt) CHORUS_BINARY_CASE(Ge)
    CHORUS_BINARY_CASE(ReluGrad) CHORUS_BINARY_CASE(TanhGrad) CHORUS_BINARY_CASE(SigmoidGrad)
    CHORUS_BINARY_CASE(GeluGrad) CHORUS_BINARY_CASE(GeluTanhGrad)
#undef CHORUS_BINARY_CASE
  }
}

template <typename T>
inline T load(const char* p) { return *reinterpret_cast<const T*>(p); }

template <typename S, typename D>
inline void convert(char* dst, const char* src) {
  if constexpr (std::is_same_v<S, D>) {
    *reinterpret_cast<D*>(dst) = load<S>(src);
  } else {
    *reinterpret_cast<D*>(dst) = from_compute<D>(static_cast<double>(to_compute(load<S>(src))));
  }
}

}  // namespace

void unary(UnaryOp op, const Tensor& x, const Tensor& out, double scalar) {
  CHORUS_CPU_DISPATCH(x.dtype(), T, {
    using C = ComputeT<T>;
    const C s = static_cast<C>(scalar);
    if (op == UnaryOp::GtScalar) {
      strided_for_each<2>({&out, &x}, [&](std::array<char*, 2> p, std::array<int64_t, 2> st, int64_t n) {
        for (int64_t i = 0; i < n; ++i)
          *reinterpret_cast<bool*>(p[0] + i * st[0]) = to_compute(load<T>(p[1] + i * st[1])) > s;
      });
    } else {
      strided_for_each<2>({&out, &x}, [&](std::array<char*, 2> p, std::array<int64_t, 2> st, int64_t n) {
        if constexpr (std::is_same_v<T, float>) {
          if (st[0] == 4 && st[1] == 4) {
            float* o = reinterpret_cast<float*>(p[0]);
            const float* a = reinterpret_cast<const float*>(p[1]);
            with_unary_op(op, [&](auto k) {
              for (int64_t i = 0; i < n; ++i) o[i] = apply_unary<float>(k.value, a[i], s);
            });
            return;
          }
        }
        for (int64_t i = 0; i < n; ++i)
          *reinterpret_cast<T*>(p[0] + i * st[0]) =
              from_compute<T>(apply_unary<C>(op, to_compute(load<T>(p[1] + i * st[1])), s));
      });
    }
  });
}

void binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out, double alpha) {
  CHORUS_CPU_DISPATCH(a.dtype(), T, {
    using C = ComputeT<T>;
    const C al = static_cast<C>(alpha);
    if (is_comparison(op)) {
      strided_for_each<3>({&out, &a, &b}, [&](std::array<char*, 3> p, std::array<int64_t, 3> st, int64_t n) {
        for (int64_t i = 0; i < n; ++i)
          *reinterpret_cast<bool*>(p[0] + i * st[0]) =
              apply_binary<C>(op, to_compute(load<T>(p[1] + i * st[1])),
                              to_compute(load<T>(p[2] + i * st[2])), al) != C(0);
      });
    } else if constexpr (std::is_same_v<T, float>) {
      strided_for_each<3>({&out, &a, &b}, [&](std::array<char*, 3> p, std::array<int64_t, 3> st, int64_t n) {
        if (st[0] == 4 && st[1] == 4 && st[2] == 4) {
          // Contiguous (residual adds, gradient accumulation, ReLU's gradient):
          // one vectorised loop per op. A broadcast operand (stride 0) too.
          float* o = reinterpret_cast<float*>(p[0]);
          const float* x = reinterpret_cast<const float*>(p[1]);
          const float* y = reinterpret_cast<const float*>(p[2]);
          with_binary_op(op, [&](auto k) {
            for (int64_t i = 0; i < n; ++i) o[i] = apply_binary<float>(k.value, x[i], y[i], al);
          });
          return;
        }
        if (st[0] == 4 && st[1] == 4 && st[2] == 0) {
          float* o = reinterpret_cast<float*>(p[0]);
          const float* x = reinterpret_cast<const float*>(p[1]);
          const float y = *reinterpret_cast<const float*>(p[2]);
          with_binary_op(op, [&](auto k) {
            for (int64_t i = 0; i < n; ++i) o[i] = apply_binary<float>(k.value, x[i], y, al);
          });
          return;
        }
        for (int64_t i = 0; i < n; ++i)
          *reinterpret_cast<float*>(p[0] + i * st[0]) =
              apply_binary<float>(op, load<float>(p[1] + i * st[1]), load<float>(p[2] + i * st[2]), al);
      });
    } else {
      strided_for_each<3>({&out, &a, &b}, [&](std::array<char*, 3> p, std::array<int64_t, 3> st, int64_t n) {
        for (int64_t i = 0; i < n; ++i)
          *reinterpret_cast<T*>(p[0] + i * st[0]) = from_compute<T>(apply_binary<C>(
              op, to_compute(load<T>(p[1] + i * st[1])), to_compute(load<T>(p[2] + i * st[2])), al));
      });
    }
  });
}

void copy(const Tensor& src, const Tensor& dst) {
  if (src.dtype() == dst.dtype() && src.is_contiguous() && dst.is_contiguous()) {
    const char* s = static_cast<const char*>(src.raw_data());
    char* d = static_cast<char*>(dst.raw_data());
    const int64_t bytes = static_cast<int64_t>(src.nbytes());
    if (s == d) return;
    parallel_for(bytes, 1 << 20, [&](int64_t b, int64_t e) { std::memmove(d + b, s + b, e - b); });
    return;
  }
  CHORUS_CPU_DISPATCH(src.dtype(), S, {
    CHORUS_CPU_DISPATCH(dst.dtype(), D, {
      strided_for_each<2>({&dst, &src}, [&](std::array<char*, 2> p, std::array<int64_t, 2> st, int64_t n) {
        for (int64_t i = 0; i < n; ++i) convert<S, D>(p[0] + i * st[0], p[1] + i * st[1]);
      });
    });
  });
}

void copy_multi(const TensorList& srcs, const TensorList& dsts) {
  CHORUS_CHECK(srcs.size() == dsts.size(), "copy_multi: ", srcs.size(), " sources but ", dsts.size(),
               " destinations");
  for (size_t i = 0; i < srcs.size(); ++i) {
    const Tensor& s = srcs[i];
    const Tensor& d = dsts[i];
    CHORUS_CHECK(s.dtype() == d.dtype() && s.numel() == d.numel() && s.is_contiguous() &&
                     d.is_contiguous() && s.device() == d.device() && d.device() == dsts[0].device(),
                 "copy_multi: pair ", i, " needs contiguous tensors of one dtype and size on ",
                 dsts[0].device().str(), ", got ", s.describe(), " -> ", d.describe());
  }
  for (size_t i = 0; i < srcs.size(); ++i) {
    const char* s = static_cast<const char*>(srcs[i].raw_data());
    char* d = static_cast<char*>(dsts[i].raw_data());
    const int64_t bytes = static_cast<int64_t>(srcs[i].nbytes());
    if (s == d || bytes == 0) continue;
    if (bytes < (1 << 20)) {
      std::memcpy(d, s, static_cast<size_t>(bytes));
      continue;
    }
    parallel_for(bytes, 1 << 20, [&](int64_t b, int64_t e) { std::memcpy(d + b, s + b, static_cast<size_t>(e - b)); });
  }
}

void fill(const Tensor& out, double value) {
  CHORUS_CPU_DISPATCH(out.dtype(), T, {
    const T v = from_compute<T>(static_cast<ComputeT<T>>(value));
    strided_for_each<1>({&out}, [&](std::array<char*, 1> p, std::array<int64_t, 1> st, int64_t n) {
      for (int64_t i = 0; i < n; ++i) *reinterpret_cast<T*>(p[0] + i * st[0]) = v;
    });
  });
}

}  // namespace chorus::cpu
