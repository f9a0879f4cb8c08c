// The op enumerations shared by the device kernel layers (cpu/, cuda/) and the
// operator layer (ops/). They live in core so that the kernel layers, which may
// use only core, can name them.
#pragma once

#include <cstdint>

namespace chorus {

enum class UnaryOp : int8_t {
  Neg, Exp, Log, Sqrt, Rsqrt, Tanh, Sigmoid, Relu, Abs, Square, Reciprocal, Sign,
  Pow,        // x ^ scalar
  AddScalar,  // x + scalar
  MulScalar,  // x * scalar
  RSubScalar, // scalar - x
  GtScalar,   // x > scalar  (output dtype bool)
  Gelu,       // x * Phi(x), Phi the normal CDF (exact, erf)
  GeluTanh,   // GPT-2's tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
};

enum class BinaryOp : int8_t {
  Add,          // a + alpha * b
  Sub,          // a - alpha * b
  Mul, Div, Max, Min,
  Eq, Ne, Lt, Le, Gt, Ge,  // output dtype bool
  ReluGrad,     // a * (b > 0)       (b: relu input)
  TanhGrad,     // a * (1 - b * b)   (b: tanh output)
  SigmoidGrad,  // a * b * (1 - b)   (b: sigmoid output)
  GeluGrad,     // a * gelu'(b)      (b: gelu input)
  GeluTanhGrad, // a * gelu_tanh'(b) (b: gelu input)
};

enum class ReduceOp : int8_t { Sum, Mean, Max, Min, Argmax, Argmin };

inline bool is_comparison(BinaryOp op) {
  return op == BinaryOp::Eq || op == BinaryOp::Ne || op == BinaryOp::Lt || op == BinaryOp::Le ||
         op == BinaryOp::Gt || op == BinaryOp::Ge;
}

// Geometry of a 2-d convolution (NCHW logical layout).
struct Conv2dGeometry {
  int64_t n, c_in, h, w, c_out, kh, kw;
  int64_t stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0, dil_h = 1, dil_w = 1, groups = 1;
  int64_t out_h() const { return (h + 2 * pad_h - dil_h * (kh - 1) - 1) / stride_h + 1; }
  int64_t out_w() const { return (w + 2 * pad_w - dil_w * (kw - 1) - 1) / stride_w + 1; }
};

// Geometry of a 2-d pooling window.
struct Pool2dGeometry {
  int64_t n, c, h, w, kh, kw;
  int64_t stride_h, stride_w, pad_h = 0, pad_w = 0;
  int64_t out_h() const { return (h + 2 * pad_h - kh) / stride_h + 1; }
  int64_t out_w() const { return (w + 2 * pad_w - kw) / stride_w + 1; }
};

}  // namespace chorus
