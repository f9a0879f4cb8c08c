#include "chorus/ops/linalg.h"

#include "chorus/core/error.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/dispatch.h"
#include "chorus/ops/elementwise.h"

#include <utility>

namespace chorus::ops {

namespace {
// A [B, R, C] operand for the GEMM: contiguous as stored, plus whether the
// logical matrix is its transpose.
struct GemmOperand {
  Tensor stored;
  bool trans = false;
};

GemmOperand as_gemm_operand(const Tensor& t3) {
  const Shape& s = t3.sizes();
  const Shape& st = t3.strides();
  if (t3.is_contiguous()) return {t3, false};
  // Logical [B, R, C] stored as contiguous [B, C, R].
  if (st[2] == s[1] && st[1] == 1 && (s[0] == 1 || st[0] == s[1] * s[2])) {
    return {detail::make_view(t3, {s[0], s[2], s[1]}, {s[1] * s[2], s[1], 1}, t3.storage_offset()), true};
  }
  return {contiguous(t3), false};
}
}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b) {
  detail::check_defined(a, "matmul", "self");
  detail::check_defined(b, "matmul", "other");
  CHORUS_CHECK(a.dim() >= 2 && b.dim() >= 2 && b.dim() <= 3, "matmul: expected [..., M, K] @ [K, N] or [B, M, K] @ [B, K, N], got ",
               a.describe(), " @ ", b.describe());
  CHORUS_CHECK(a.size(-1) == b.size(-2), "matmul: inner dimensions differ: ", shape_str(a.sizes()),
               " @ ", shape_str(b.sizes()), " (", a.size(-1), " vs ", b.size(-2), ")");
  CHORUS_CHECK(is_floating(a.dtype()), "matmul: expected floating tensors, got ", a.describe());
  Device dev = a.device();
  DType dt = promote_types(a.dtype(), b.dtype());
  Tensor ta = to_dtype(a, dt), tb = to_dtype(operand_to_device(b, dev), dt);
  const int64_t m = a.size(-2), k = a.size(-1), n = b.size(-1);
  Tensor a3, b3;
  Shape out_shape;
  if (b.dim() == 2) {
    out_shape = a.sizes();
    out_shape.back() = n;
    // Not numel / k: K may be 0 (an empty inner dimension gives zeros).
    int64_t rows = 1;
    for (int64_t d = 0; d + 1 < a.dim(); ++d) rows *= a.size(d);
    Tensor ca = a.dim() == 2 ? ta : contiguous(ta);
    a3 = a.dim() == 2 ? detail::make_view(ta, {1, m, k}, {0, ta.stride(0), ta.stride(1)}, ta.storage_offset())
                      : detail::make_view(ca, {1, rows, k}, {rows * k, k, 1}, ca.storage_offset());
    b3 = detail::make_view(tb, {1, k, n}, {0, tb.stride(0), tb.stride(1)}, tb.storage_offset());
  } else {
    CHORUS_CHECK(a.dim() == 3 && a.size(0) == b.size(0), "matmul: batch sizes differ: ",
                 shape_str(a.sizes()), " @ ", shape_str(b.sizes()));
    out_shape = {a.size(0), m, n};
    a3 = ta;
    b3 = tb;
  }
  GemmOperand ga = as_gemm_operand(a3), gb = as_gemm_operand(b3);
  Tensor out = detail::empty_tensor({a3.size(0), a3.size(1), n}, dt, dev);
  if (out.numel()) {
    if (k == 0) {
      CHORUS_KERNEL(dev, fill, out, 0.0);
    } else {
      CHORUS_KERNEL(dev, gemm, ga.stored, gb.stored, out, ga.trans, gb.trans, 1.0, 0.0);
    }
  }
  Shape out_strides = contiguous_strides(out_shape);
  return detail::make_view(out, std::move(out_shape), std::move(out_strides), 0);
}

}  // namespace chorus::ops
