#include "chorus/ops/linear.h"

#include "chorus/core/error.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/dispatch.h"

namespace chorus::ops {

Tensor linear_bias(const Tensor& x, const Tensor& w, const Tensor& b) {
  CHORUS_CHECK(x.dim() == 2 && w.dim() == 2 && b.dim() == 1 && x.size(1) == w.size(1) && b.size(0) == w.size(0),
               "linear: x ", x.describe(), ", weight ", w.describe(), " and bias ", b.describe(), " do not fit");
  CHORUS_CHECK(x.dtype() == w.dtype() && x.dtype() == b.dtype() && x.device() == w.device() &&
                   x.device() == b.device(),
               "linear: x, weight and bias must share one dtype and device, got ", x.describe(), ", ", w.describe(),
               ", ", b.describe());
  const Tensor xc = contiguous(x), wc = contiguous(w), bc = contiguous(b);
  Tensor y = detail::empty_tensor({x.size(0), w.size(0)}, x.dtype(), x.device());
  CHORUS_KERNEL(x.device(), gemm_bias, xc, wc, y, false, true, bc, Tensor());
  return y;
}

std::tuple<Tensor, Tensor, Tensor> linear_bias_backward(const Tensor& dy, const Tensor& x, const Tensor& w,
                                                        bool need_dx) {
  const Device dev = x.device();
  const Tensor g = contiguous(to_dtype(to_device(dy, dev), x.dtype()));
  const Tensor xc = contiguous(x), wc = contiguous(w);
  CHORUS_CHECK(g.dim() == 2 && g.size(0) == x.size(0) && g.size(1) == w.size(0), "linear: gradient ",
               dy.describe(), " does not fit x ", x.describe(), " and weight ", w.describe());
  Tensor dx;
  if (need_dx) {
    dx = detail::empty_tensor(x.sizes(), x.dtype(), dev);
    CHORUS_KERNEL(dev, gemm_bias, g, wc, dx, false, false, Tensor(), Tensor());  // dy w
  }
  Tensor dw = detail::empty_tensor(w.sizes(), w.dtype(), dev);
  Tensor db = detail::empty_tensor({w.size(0)}, w.dtype(), dev);
  CHORUS_KERNEL(dev, gemm_bias, g, xc, dw, true, false, Tensor(), db);  // dy^T x, and dy's column sums
  return {dx, dw, db};
}

}  // namespace chorus::ops
