#include "chorus/ops/elementwise.h"

#include "chorus/core/error.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/dispatch.h"

#include <utility>

namespace chorus::ops {

namespace {
int float_rank(DType t) {
  switch (t) {
    case kFloat64: return 4;
    case kFloat32: return 3;
    case kBFloat16: return 2;
    case kFloat16: return 2;
    default: return 0;
  }
}
int int_rank(DType t) {
  switch (t) {
    case kInt64: return 4;
    case kInt32: return 3;
    case kUInt8: return 2;
    case kBool: return 1;
    default: return 0;
  }
}
// The user-facing name of a binary op, for error messages.
const char* binary_name(BinaryOp op) {
  switch (op) {
    case BinaryOp::Add: return "add";
    case BinaryOp::Sub: return "sub";
    case BinaryOp::Mul: return "mul";
    case BinaryOp::Div: return "div";
    case BinaryOp::Max: return "maximum";
    case BinaryOp::Min: return "minimum";
    case BinaryOp::Eq: return "eq";
    case BinaryOp::Ne: return "ne";
    case BinaryOp::Lt: return "lt";
    case BinaryOp::Le: return "le";
    case BinaryOp::Gt: return "gt";
    case BinaryOp::Ge: return "ge";
    case BinaryOp::ReluGrad: return "relu_backward";
    case BinaryOp::TanhGrad: return "tanh_backward";
    case BinaryOp::SigmoidGrad: return "sigmoid_backward";
    case BinaryOp::GeluGrad: return "gelu_backward";
    case BinaryOp::GeluTanhGrad: return "gelu_tanh_backward";
  }
  return "elementwise op";
}
}  // namespace

DType promote_types(DType a, DType b) {
  if (a == b) return a;
  int fa = float_rank(a), fb = float_rank(b);
  if (fa || fb) {
    if (fa == fb) return kFloat32;  // bfloat16 with float16
    return fa > fb ? a : b;
  }
  return int_rank(a) > int_rank(b) ? a : b;
}

Tensor broadcast_to(const Tensor& t, const Shape& shape, const char* op) {
  if (t.sizes() == shape) return t;
  CHORUS_CHECK(static_cast<int64_t>(shape.size()) >= t.dim(), op, ": cannot broadcast ",
               shape_str(t.sizes()), " to ", shape_str(shape));
  Shape strides(shape.size(), 0);
  int64_t lead = static_cast<int64_t>(shape.size()) - t.dim();
  for (int64_t i = 0; i < t.dim(); ++i) {
    CHORUS_CHECK(t.size(i) == shape[lead + i] || t.size(i) == 1, op, ": cannot broadcast ",
                 shape_str(t.sizes()), " to ", shape_str(shape));
    strides[lead + i] = t.size(i) == 1 && shape[lead + i] != 1 ? 0 : t.stride(i);
  }
  return detail::make_view(t, Shape(shape), std::move(strides), t.storage_offset());
}

Tensor unary(UnaryOp op, const Tensor& x, double scalar) {
  detail::check_defined(x, "unary op", "self");
  DType out_dt = op == UnaryOp::GtScalar ? kBool : x.dtype();
  Tensor in = x;
  // Transcendental ops on integer tensors compute in float32, as PyTorch does.
  bool needs_float = op == UnaryOp::Exp || op == UnaryOp::Log || op == UnaryOp::Sqrt ||
                     op == UnaryOp::Rsqrt || op == UnaryOp::Tanh || op == UnaryOp::Sigmoid ||
                     op == UnaryOp::Reciprocal || op == UnaryOp::Pow;
  if (needs_float && !is_floating(x.dtype())) {
    in = to_dtype(x, kFloat32);
    out_dt = kFloat32;
  }
  Tensor out = empty_like_layout(x, x.sizes(), out_dt);
  if (out.numel() == 0) return out;
  if (same_dense_layout({&in, &out})) {
    CHORUS_KERNEL(x.device(), unary, op, flat_view(in), flat_view(out), scalar);
  } else {
    CHORUS_KERNEL(x.device(), unary, op, in, out, scalar);
  }
  return out;
}

void unary_(UnaryOp op, const Tensor& self, double scalar) {
  if (self.numel() && same_dense_layout({&self})) {
    Tensor f = flat_view(self);
    CHORUS_KERNEL(self.device(), unary, op, f, f, scalar);
  } else if (self.numel()) {
    CHORUS_KERNEL(self.device(), unary, op, self, self, scalar);
  }
  self.bump_version();
}

Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b, double alpha) {
  const char* name = binary_name(op);
  detail::check_defined(a, name, "self");
  detail::check_defined(b, name, "other");
  Shape shape = broadcast_shapes(a.sizes(), b.sizes(), name);
  DType dt = promote_types(a.dtype(), b.dtype());
  Device dev = a.device();
  Tensor ta = to_dtype(a, dt);
  Tensor tb = to_dtype(operand_to_device(b, dev), dt);
  // The output is channels-last when either full-shape operand is: a gradient
  // arriving in NCHW must not turn a channels-last network's backward pass
  // NCHW (mixed layouts leave the flat, vectorised kernels and cuDNN's NHWC
  // kernels behind).
  const bool cl = (a.sizes() == shape && is_channels_last(a)) || (b.sizes() == shape && is_channels_last(b));
  Tensor out = empty_with_layout(shape, is_comparison(op) ? kBool : dt, dev, cl);
  if (out.numel() == 0) return out;
  Tensor va = broadcast_to(ta, shape, name), vb = broadcast_to(tb, shape, name);
  if (same_dense_layout({&va, &vb, &out})) {
    CHORUS_KERNEL(dev, binary, op, flat_view(va), flat_view(vb), flat_view(out), alpha);
  } else {
    CHORUS_KERNEL(dev, binary, op, va, vb, out, alpha);
  }
  return out;
}

void binary_(BinaryOp op, const Tensor& self, const Tensor& other, double alpha) {
  const std::string name = std::string(binary_name(op)) + "_";  // "add_", "mul_"
  detail::check_defined(self, name.c_str(), "self");
  detail::check_defined(other, name.c_str(), "other");
  Tensor o = to_dtype(operand_to_device(other, self.device()), self.dtype());
  Tensor ob = broadcast_to(o, self.sizes(), name.c_str());
  if (self.numel() && same_dense_layout({&self, &ob})) {
    Tensor fs = flat_view(self);
    CHORUS_KERNEL(self.device(), binary, op, fs, flat_view(ob), fs, alpha);
  } else if (self.numel()) {
    CHORUS_KERNEL(self.device(), binary, op, self, ob, self, alpha);
  }
  self.bump_version();
}

}  // namespace chorus::ops
