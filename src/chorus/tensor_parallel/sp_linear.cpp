#include "chorus/tensor_parallel/sp_linear.h"

#include <tuple>
#include <vector>

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

namespace {

// The operands as nn::functional::linear / mlp_gelu compute with them: under
// autocast the input in the autocast dtype and each weight's kept copy (Note
// [Autocast weight copies]); as they are otherwise.
struct Operands {
  Tensor x;
  std::vector<Tensor> w;
  Operands(const Tensor& input, std::initializer_list<Tensor> weights) : x(input), w(weights) {
    if (auto dt = autocast_dtype(input)) {
      x = chorus::to_dtype(input, *dt);
      for (Tensor& t : w)
        if (t.defined()) t = autocast_weight(t, *dt);
    }
  }
  // One dtype and device for all (what the fused kernels take).
  bool uniform() const {
    for (const Tensor& t : w)
      if (!t.defined() || t.dtype() != x.dtype() || t.device() != x.device()) return false;
    return true;
  }
};

// The ranks' [m, k] chunks of a contiguous input, side by side as all_gather
// leaves them: rank-major [n m, k].
Tensor gather_rows(const Tensor& x, int64_t m, const dist::ProcessGroupPtr& group) {
  return all_gather_along(ops::view(ops::contiguous(x.detach()), {m, x.size(-1)}), group, 0);
}

// Note [The row-parallel bias on one rank]: the bias rank 0's product carries; zeros on the others.
Tensor bias_on_rank0(const Tensor& b, const dist::ProcessGroupPtr& group) {
  if (group->rank() == 0) return b;
  Tensor z = chorus::detail::empty_tensor(b.sizes(), b.dtype(), b.device());
  z.fill_(0);
  return z;
}

// The backward of a product y = x_full w^T + b whose x_full was all-gathered:
// (dx, this rank's reduce-scattered chunk [m, k] -- undefined unless need_dx
// --, dw, db). Note [Reduce-scatter beside the weight gradient]: dx_full
// first, its reduce-scatter issued, then dw and db while it runs.
std::tuple<Tensor, Tensor, Tensor> gathered_linear_backward(const Tensor& dy_full, const Tensor& x_full,
                                                            const Tensor& w, int64_t m, bool need_dx,
                                                            const dist::ProcessGroupPtr& group) {
  Tensor dx;
  dist::WorkPtr work;
  if (need_dx) {
    Tensor dx_full = ops::matmul(dy_full, w);  // [n m, k]
    dx = chorus::detail::empty_tensor({m, w.size(1)}, dx_full.dtype(), dx_full.device());
    work = group->reduce_scatter(dx_full, dx, dist::ReduceOp::Sum);
  }
  auto [unused, dw, db] = ops::linear_bias_backward(dy_full, x_full, w, /*need_dx=*/false);
  if (work) work->wait();
  return {dx, dw, db};
}

}  // namespace

Tensor gather_linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const dist::ProcessGroupPtr& group) {
  if (!is_parallel(group)) return nn::functional::linear(x, weight, bias);
  const Operands o(x, {weight, bias});
  const Tensor &xx = o.x, &w = o.w[0], &b = o.w[1];
  if (!(x.dim() == 3 && w.dim() == 2 && xx.size(2) == w.size(1) && o.uniform()))
    return nn::functional::linear(gather_from_sp(x.contiguous(), group, 0), weight, bias);
  const int n = group->size();
  const int64_t batch = xx.size(0), rows = xx.size(1), m = batch * rows;
  Tensor full = gather_rows(xx, m, group);  // rank-major [n m, k]
  Tensor wd = w.detach();
  Tensor y = ops::view(ops::linear_bias(full, wd, b.detach()), {n * batch, rows, w.size(0)});
  const bool need_dx = xx.requires_grad();
  const Shape x_shape = xx.sizes();
  return autograd::record("GatherLinearBackward", y, {xx, w, b}, [full, wd, group, x_shape, m, need_dx](const TensorList& g) {
    Tensor g2 = ops::view(ops::contiguous(g[0]), {full.size(0), wd.size(0)});
    auto [dx, dw, db] = gathered_linear_backward(g2, full, wd, m, need_dx, group);
    return TensorList{dx.defined() ? ops::view(dx, x_shape) : Tensor(), dw, db};
  });
}

Tensor linear_reduce_scatter(const Tensor& x, const Tensor& weight, const Tensor& bias,
                             const dist::ProcessGroupPtr& group) {
  CHORUS_CHECK(is_parallel(group) && bias.defined(), "linear_reduce_scatter: needs a group of 2+ ranks and a bias");
  const int n = group->size();
  const Operands o(x, {weight, bias});
  const Tensor &xx = o.x, &w = o.w[0], &b = o.w[1];
  if (!(x.dim() == 3 && w.dim() == 2 && xx.size(2) == w.size(1) && xx.size(0) % n == 0 && o.uniform()))
    return chorus::add(reduce_scatter_to_sp(nn::functional::linear(x, weight, Tensor()), group, 0),
                       copy_param_to_tp(bias, group));
  const int64_t rows = xx.size(1), batch = xx.size(0) / n, m = batch * rows;
  Tensor x2 = ops::view(ops::contiguous(xx.detach()), {n * m, xx.size(2)});
  Tensor wd = w.detach();
  Tensor partial = ops::linear_bias(x2, wd, bias_on_rank0(b.detach(), group));  // [n m, out], rank-major
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
  const Operands o(x, {w1, b1, w2, b2});
  const Tensor &xx = o.x, &a = o.w[0], &ab = o.w[1], &c = o.w[2], &cb = o.w[3];
  if (!(x.dim() == 3 && x.numel() > 0 && a.dim() == 2 && c.dim() == 2 && xx.size(2) == a.size(1) &&
        c.size(1) == a.size(0) && o.uniform())) {
    Tensor h = nn::functional::gelu(gather_linear(x, w1, b1, group), /*tanh_approximation=*/true);
    return linear_reduce_scatter(h, w2, b2, group);
  }
  const int64_t batch = xx.size(0), rows = xx.size(1), m = batch * rows;
  Tensor full = gather_rows(xx, m, group);  // rank-major [n m, C]
  Tensor ad = a.detach(), cd = c.detach();
  auto [partial, pre, h] = ops::mlp_gelu(full, ad, ab.detach(), cd, bias_on_rank0(cb.detach(), group));
  Tensor y = ops::view(reduce_scatter_along(partial, group, 0), {batch, rows, cd.size(0)});
  const bool need_dx = xx.requires_grad();
  const Shape x_shape = xx.sizes();
  return autograd::record(
      "SpMlpBackward", y, {xx, a, ab, c, cb}, [full, ad, cd, pre, h, group, x_shape, m, need_dx](const TensorList& g) {
        Tensor g_full = all_gather_along(ops::view(ops::contiguous(g[0]), {m, cd.size(0)}), group, 0);
        auto [dpre, dw2, db2] = ops::mlp_gelu_backward_second(g_full, cd, pre, h);
        auto [dx, dw1, db1] = gathered_linear_backward(dpre, full, ad, m, need_dx, group);
        return TensorList{dx.defined() ? ops::view(dx, x_shape) : Tensor(), dw1, db1, dw2, db2};
      });
}

}  // namespace chorus::tp
