#include "chorus/tensor_parallel/sp_linear.h"

#include "chorus/autograd/autocast.h"
#include "chorus/autograd/functions.h"
#include "chorus/autograd/node.h"
#include "chorus/core/error.h"
#include "chorus/nn/functional.h"
#include "chorus/ops/linalg.h"
#include "chorus/ops/linear.h"
#include "chorus/ops/views.h"
#include "chorus/tensor_parallel/mappings.h"

namespace chorus::tp {

Tensor gather_linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const dist::ProcessGroupPtr& group) {
  if (!is_parallel(group)) return nn::functional::linear(x, weight, bias);
  Tensor xx = x, w = weight, b = bias;
  if (auto dt = autocast_dtype(x)) {  // as nn::functional::linear (Note [Autocast weight copies])
    xx = chorus::to_dtype(x, *dt);
    w = autocast_weight(weight, *dt);
    if (bias.defined()) b = autocast_weight(bias, *dt);
  }
  const bool fits = x.dim() == 3 && b.defined() && w.dim() == 2 && xx.size(2) == w.size(1) && xx.dtype() == w.dtype() &&
                    xx.dtype() == b.dtype() && xx.device() == w.device() && xx.device() == b.device();
  if (!fits) return nn::functional::linear(gather_from_sp(x.contiguous(), group, 0), weight, bias);
  const int n = group->size();
  const int64_t batch = xx.size(0), rows = xx.size(1), k = xx.size(2), m = batch * rows;
  // The ranks' chunks side by side, as all_gather leaves them: rank-major.
  Tensor full = all_gather_along(ops::view(ops::contiguous(xx.detach()), {m, k}), group, 0);  // [n m, k]
  Tensor wd = w.detach(), bd = b.detach();
  Tensor y = ops::view(ops::linear_bias(full, wd, bd), {n * batch, rows, w.size(0)});
  const bool need_dx = xx.requires_grad();
  const Shape x_shape = xx.sizes();
  return autograd::record("GatherLinearBackward", y, {xx, w, b}, [full, wd, group, x_shape, m, need_dx](const TensorList& g) {
    Tensor g2 = ops::view(ops::contiguous(g[0]), {full.size(0), wd.size(0)});
    // Note [Reduce-scatter beside the weight gradient]: dx first, its
    // reduce-scatter issued, then dw and db while it runs.
    Tensor dx;
    dist::WorkPtr work;
    if (need_dx) {
      Tensor dx_full = ops::matmul(g2, wd);  // [n m, k]
      dx = chorus::detail::empty_tensor({m, wd.size(1)}, dx_full.dtype(), dx_full.device());
      work = group->reduce_scatter(dx_full, dx, dist::ReduceOp::Sum);
    }
    auto [unused, dw, db] = ops::linear_bias_backward(g2, full, wd, /*need_dx=*/false);
    if (work) work->wait();
    return TensorList{dx.defined() ? ops::view(dx, x_shape) : Tensor(), dw, db};
  });
}

Tensor linear_reduce_scatter(const Tensor& x, const Tensor& weight, const Tensor& bias,
                             const dist::ProcessGroupPtr& group) {
  CHORUS_CHECK(is_parallel(group) && bias.defined(), "linear_reduce_scatter: needs a group of 2+ ranks and a bias");
  Tensor xx = x, w = weight, b = bias;
  if (auto dt = autocast_dtype(x)) {  // as nn::functional::linear (Note [Autocast weight copies])
    xx = chorus::to_dtype(x, *dt);
    w = autocast_weight(weight, *dt);
    b = autocast_weight(bias, *dt);
  }
  const int n = group->size();
  const bool fits = x.dim() == 3 && w.dim() == 2 && xx.size(2) == w.size(1) && xx.size(0) % n == 0 &&
                    xx.dtype() == w.dtype() && xx.dtype() == b.dtype() && xx.device() == w.device() &&
                    xx.device() == b.device();
  CHORUS_CHECK(fits, "linear_reduce_scatter: x ", xx.describe(), ", weight ", w.describe(), " and bias ", b.describe(),
               " do not fit one fused op");
  const int64_t rows = xx.size(1), batch = xx.size(0) / n, m = batch * rows, k = xx.size(2);
  Tensor x2 = ops::view(ops::contiguous(xx.detach()), {n * m, k});
  Tensor wd = w.detach(), bd = b.detach();
  // Note [The row-parallel bias on one rank]
  Tensor own_bias = group->rank() == 0 ? bd : chorus::detail::empty_tensor(bd.sizes(), bd.dtype(), bd.device()).fill_(0);
  Tensor partial = ops::linear_bias(x2, wd, own_bias);  // [n m, out], rank-major
  Tensor y = ops::view(reduce_scatter_along(partial, group, 0), {batch, rows, w.size(0)});
  const bool need_dx = xx.requires_grad();
  const Shape x_shape = xx.sizes();
  return autograd::record("LinearReduceScatterBackward", y, {xx, w, b}, [x2, wd, group, x_shape, m, need_dx](const TensorList& g) {
    Tensor g_full = all_gather_along(ops::view(ops::contiguous(g[0]), {m, wd.size(0)}), group, 0);  // [n m, out]
    auto [dx, dw, db] = ops::linear_bias_backward(g_full, x2, wd, need_dx);
    return TensorList{dx.defined() ? ops::view(dx, x_shape) : Tensor(), dw, db};
  });
}

Tensor sp_mlp(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2,
              const dist::ProcessGroupPtr& group) {
  CHORUS_CHECK(is_parallel(group), "sp_mlp: needs a group of 2+ ranks");
  Tensor xx = x, a = w1, ab = b1, c = w2, cb = b2;
  if (auto dt = autocast_dtype(x)) {  // as nn::functional::mlp_gelu (Note [Autocast weight copies])
    xx = chorus::to_dtype(x, *dt);
    a = autocast_weight(w1, *dt);
    ab = autocast_weight(b1, *dt);
    c = autocast_weight(w2, *dt);
    cb = autocast_weight(b2, *dt);
  }
  bool fits = x.dim() == 3 && x.numel() > 0 && a.dim() == 2 && c.dim() == 2 && xx.size(2) == a.size(1) &&
              c.size(1) == a.size(0);
  for (const Tensor* t : {&a, &ab, &c, &cb}) fits = fits && t->dtype() == xx.dtype() && t->device() == xx.device();
  if (!fits) {
    Tensor h = nn::functional::gelu(gather_linear(x, w1, b1, group), /*tanh_approximation=*/true);
    return linear_reduce_scatter(h, w2, b2, group);
  }
  const int n = group->size();
  const int64_t batch = xx.size(0), rows = xx.size(1), m = batch * rows, k = xx.size(2);
  Tensor full = all_gather_along(ops::view(ops::contiguous(xx.detach()), {m, k}), group, 0);  // [n m, C], rank-major
  Tensor ad = a.detach(), cd = c.detach(), cbd = cb.detach();
  // Note [The row-parallel bias on one rank]
  Tensor own_b2 = group->rank() == 0 ? cbd : chorus::detail::empty_tensor(cbd.sizes(), cbd.dtype(), cbd.device()).fill_(0);
  auto [partial, pre, h] = ops::mlp_gelu(full, ad, ab.detach(), cd, own_b2);
  Tensor y = ops::view(reduce_scatter_along(partial, group, 0), {batch, rows, cd.size(0)});
  const bool need_dx = xx.requires_grad();
  const Shape x_shape = xx.sizes();
  return autograd::record(
      "SpMlpBackward", y, {xx, a, ab, c, cb}, [full, ad, cd, pre, h, group, x_shape, m, need_dx](const TensorList& g) {
        Tensor g_full = all_gather_along(ops::view(ops::contiguous(g[0]), {m, cd.size(0)}), group, 0);
        auto [dpre, dw2, db2] = ops::mlp_gelu_backward_second(g_full, cd, pre, h);
        // Note [Reduce-scatter beside the weight gradient]
        Tensor dx;
        dist::WorkPtr work;
        if (need_dx) {
          Tensor dx_full = ops::matmul(dpre, ad);  // [n m, C]
          dx = chorus::detail::empty_tensor({m, ad.size(1)}, dx_full.dtype(), dx_full.device());
          work = group->reduce_scatter(dx_full, dx, dist::ReduceOp::Sum);
        }
        auto [unused, dw1, db1] = ops::linear_bias_backward(dpre, full, ad, /*need_dx=*/false);
        if (work) work->wait();
        return TensorList{dx.defined() ? ops::view(dx, x_shape) : Tensor(), dw1, db1, dw2, db2};
      });
}

}  // namespace chorus::tp
