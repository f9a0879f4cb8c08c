#include "chorus/ops/linear.h"

#include "chorus/core/error.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/dispatch.h"

namespace chorus::ops {

namespace {

void check_linear(const Tensor& x, const Tensor& w, const Tensor& b) {
  CHORUS_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && (!b.defined() || (b.dim() == 1 && b.size(0) == w.size(0))),
               "linear: x ", x.describe(), ", weight ", w.describe(), " and bias ", b.describe(), " do not fit");
  CHORUS_CHECK(x.dtype() == w.dtype() && x.device() == w.device() &&
                   (!b.defined() || (x.dtype() == b.dtype() && x.device() == b.device())),
               "linear: x, weight and bias must share one dtype and device, got ", x.describe(), ", ", w.describe(),
               ", ", b.describe());
}

void check_out(const char* op, const Tensor& out, const Tensor& x, Shape sizes) {
  CHORUS_CHECK(out.is_contiguous() && out.sizes() == sizes && out.dtype() == x.dtype() && out.device() == x.device(),
               op, ": the output ", out.describe(), " must be a contiguous ", x.dtype(), " tensor of ", sizes.size(),
               " dims on ", x.device(), " fitting ", x.describe());
}

}  // namespace

Tensor linear_bias(const Tensor& x, const Tensor& w, const Tensor& b) {
  CHORUS_CHECK(b.defined(), "linear: the bias is undefined");
  check_linear(x, w, b);
  Tensor y = detail::empty_tensor({x.size(0), w.size(0)}, x.dtype(), x.device());
  linear_bias_into(x, w, b, y);
  return y;
}

void linear_bias_into(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y) {
  check_linear(x, w, b);
  check_out("linear", y, x, {x.size(0), w.size(0)});
  const Tensor xc = contiguous(x), wc = contiguous(w), bc = b.defined() ? contiguous(b) : Tensor();
  CHORUS_KERNEL(x.device(), gemm_bias, xc, wc, y, false, true, bc, Tensor());
}

void linear_input_grad_into(const Tensor& dy, const Tensor& w, const Tensor& dx) {
  CHORUS_CHECK(dy.dim() == 2 && w.dim() == 2 && dy.size(1) == w.size(0) && dy.dtype() == w.dtype() &&
                   dy.device() == w.device(),
               "linear: gradient ", dy.describe(), " does not fit weight ", w.describe());
  check_out("linear backward", dx, dy, {dy.size(0), w.size(1)});
  const Tensor gc = contiguous(dy), wc = contiguous(w);
  CHORUS_KERNEL(dy.device(), gemm_bias, gc, wc, dx, false, false, Tensor(), Tensor());  // dy w
}

std::tuple<Tensor, Tensor, Tensor> linear_bias_backward(const Tensor& dy, const Tensor& x, const Tensor& w,
                                                        bool need_dx, bool need_db, std::optional<DType> grad_dtype) {
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
  const DType gd = grad_dtype.value_or(w.dtype());
  Tensor dw = detail::empty_tensor(w.sizes(), gd, dev);
  Tensor db = need_db ? detail::empty_tensor({w.size(0)}, gd, dev) : Tensor();
  CHORUS_KERNEL(dev, gemm_bias, g, xc, dw, true, false, Tensor(), db);  // dy^T x, and dy's column sums
  return {dx, dw, db};
}

std::tuple<Tensor, Tensor, Tensor> mlp_gelu(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2,
                                            const Tensor& b2) {
  CHORUS_CHECK(x.dim() == 2 && w1.dim() == 2 && w2.dim() == 2, "mlp: x ", x.describe(), ", w1 ", w1.describe(), ", w2 ",
               w2.describe(), " must be 2-d");
  Tensor y = detail::empty_tensor({x.size(0), w2.size(0)}, x.dtype(), x.device());
  Tensor pre = detail::empty_tensor({x.size(0), w1.size(0)}, x.dtype(), x.device());
  Tensor h = detail::empty_tensor(pre.sizes(), x.dtype(), x.device());
  mlp_gelu_into(x, w1, b1, w2, b2, y, pre, h);
  return {y, pre, h};
}

void mlp_gelu_into(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2,
                   const Tensor& y, const Tensor& pre, const Tensor& h) {
  CHORUS_CHECK(x.dim() == 2 && w1.dim() == 2 && w2.dim() == 2 && x.size(1) == w1.size(1) && w2.size(1) == w1.size(0) &&
                   b1.numel() == w1.size(0) && b2.numel() == w2.size(0),
               "mlp: x ", x.describe(), ", w1 ", w1.describe(), ", b1 ", b1.describe(), ", w2 ", w2.describe(), ", b2 ",
               b2.describe(), " do not fit");
  check_out("mlp", pre, x, {x.size(0), w1.size(0)});
  check_out("mlp", h, x, {x.size(0), w1.size(0)});
  const Tensor xc = contiguous(x), w1c = contiguous(w1), b1c = contiguous(b1);
  CHORUS_KERNEL(x.device(), gemm_bias_gelu, xc, w1c, b1c, pre, h);
  linear_bias_into(h, w2, b2, y);
}

std::tuple<Tensor, Tensor, Tensor> mlp_gelu_backward_second(const Tensor& dy, const Tensor& w2, const Tensor& pre,
                                                            const Tensor& h, std::optional<DType> grad_dtype,
                                                            Tensor* db1) {
  const Device dev = h.device();
  const Tensor g = contiguous(to_dtype(to_device(dy, dev), h.dtype()));
  const Tensor w2c = contiguous(w2);
  CHORUS_CHECK(g.dim() == 2 && g.size(0) == h.size(0) && g.size(1) == w2.size(0) && pre.sizes() == h.sizes(),
               "mlp backward: gradient ", dy.describe(), " does not fit h ", h.describe(), " and w2 ", w2.describe());
  // The second product: dw2 = dy^T h with db2 from dy's column sums.
  const DType gd = grad_dtype.value_or(w2.dtype());
  Tensor dw2 = detail::empty_tensor(w2.sizes(), gd, dev), db2 = detail::empty_tensor({w2.size(0)}, gd, dev);
  CHORUS_KERNEL(dev, gemm_bias, g, h, dw2, true, false, Tensor(), db2);
  // dpre = (dy w2) * gelu'(pre), and db1 its column sums when asked for.
  Tensor dpre = detail::empty_tensor(pre.sizes(), pre.dtype(), dev);
  if (db1) *db1 = detail::empty_tensor({pre.size(1)}, gd, dev);
  CHORUS_KERNEL(dev, gemm_dgelu, g, w2c, pre, dpre, db1 ? *db1 : Tensor());
  return {dpre, dw2, db2};
}

std::vector<Tensor> mlp_gelu_backward(const Tensor& dy, const Tensor& x, const Tensor& w1, const Tensor& w2,
                                      const Tensor& pre, const Tensor& h, bool need_dx,
                                      std::optional<DType> grad_dtype) {
  Tensor db1;
  auto [dpre, dw2, db2] = mlp_gelu_backward_second(to_device(dy, x.device()), w2, pre, h, grad_dtype, &db1);
  auto [dx, dw1, unused] = linear_bias_backward(dpre, x, w1, need_dx, /*need_db=*/false, grad_dtype);
  return {dx, dw1, db1, dw2, db2};
}

}  // namespace chorus::ops
