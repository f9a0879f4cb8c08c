#include "chorus/ops/reduce.h"

#include "chorus/core/error.h"
#include "chorus/ops/dispatch.h"

#include <utility>

namespace chorus::ops {

Tensor reduce(ReduceOp op, const Tensor& x, const Shape& dims, bool keepdim) {
  detail::check_defined(x, "reduce", "self");
  const int64_t nd = x.dim();
  std::vector<bool> red(nd, dims.empty());
  for (int64_t d : dims) red[wrap_dim(d, nd, "reduce")] = true;
  bool is_arg = op == ReduceOp::Argmax || op == ReduceOp::Argmin;
  Shape keep_shape, out_shape;
  for (int64_t d = 0; d < nd; ++d) {
    keep_shape.push_back(red[d] ? 1 : x.size(d));
    if (!red[d] || keepdim) out_shape.push_back(red[d] ? 1 : x.size(d));
  }
  DType dt = is_arg ? kInt64 : x.dtype();
  if ((op == ReduceOp::Sum || op == ReduceOp::Mean) && !is_floating(x.dtype()))
    dt = op == ReduceOp::Mean ? kFloat32 : kInt64;
  Tensor src = x;
  if (!is_arg && dt != x.dtype()) {
    Tensor c = detail::empty_tensor(x.sizes(), dt, x.device());
    CHORUS_KERNEL(x.device(), copy, x, c);
    src = c;
  }
  Tensor out = detail::empty_tensor(keep_shape, dt, x.device());
  if (nd == 0) {
    CHORUS_KERNEL(x.device(), copy, src, out);
  } else if (out.numel()) {
    CHORUS_KERNEL(x.device(), reduce, op, src, out, red);
  }
  Shape out_strides = contiguous_strides(out_shape);
  return detail::make_view(out, std::move(out_shape), std::move(out_strides), 0);
}

Tensor sum_to(const Tensor& g, const Shape& shape) {
  if (g.sizes() == shape) return g;
  Shape dims;
  int64_t lead = g.dim() - static_cast<int64_t>(shape.size());
  for (int64_t d = 0; d < g.dim(); ++d) {
    if (d < lead || (shape[d - lead] == 1 && g.size(d) != 1)) dims.push_back(d);
  }
  Tensor r = dims.empty() ? g : reduce(ReduceOp::Sum, g, dims, true);
  return detail::make_view(r, Shape(shape), contiguous_strides(shape), r.storage_offset());
}

}  // namespace chorus::ops
