// Raw (non-differentiable) elementwise ops with broadcasting, type promotion
// and cross-device operands (Note [Cross-device operands] in copy.h).
#pragma once

#include "chorus/core/op_kinds.h"
#include "chorus/core/tensor.h"

namespace chorus::ops {

DType promote_types(DType a, DType b);
Tensor unary(UnaryOp op, const Tensor& x, double scalar = 0);
Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b, double alpha = 1);
// self = op(self, other) with other broadcast to self's shape; runs on self's device.
void binary_(BinaryOp op, const Tensor& self, const Tensor& other, double alpha = 1);
void unary_(UnaryOp op, const Tensor& self, double scalar);
// Broadcast view of t with `shape` (stride 0 on broadcast dims).
Tensor broadcast_to(const Tensor& t, const Shape& shape, const char* op);

}  // namespace chorus::ops
