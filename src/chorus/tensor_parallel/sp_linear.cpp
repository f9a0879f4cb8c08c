#include "chorus/tensor_parallel/sp_linear.h"

#include <tuple>
#include <utility>
#include <vector>

#include "chorus/autograd/autocast.h"
#include "chorus/autograd/functions.h"
#include "chorus/autograd/node.h"
#include "chorus/core/error.h"
#include "chorus/nn/functional.h"
#include "chorus/ops/linear.h"
#include "chorus/ops/views.h"
#include "chorus/tensor_parallel/chunks.h"
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

// Note [Chunked collectives beside the products]: rows [c * n * mc, (c + 1) * n * mc) of a gathered
// [n m, f] buffer hold chunk c of every rank (mc = m / K rows each); rows [c * mc, (c + 1) * mc) of a
// rank's own [m, f].
Tensor gathered_chunk(const Tensor& full, int n, int64_t mc, int c) { return full.narrow(0, c * n * mc, n * mc); }
Tensor own_rows(const Tensor& x, int64_t mc, int c) { return x.narrow(0, c * mc, mc); }

// The ranks' [m, f] inputs gathered chunk-major into `full` [n m, f], one
// all-gather per chunk, all issued at once; the caller waits for chunk c
// before reading its rows.
std::vector<dist::WorkPtr> gather_chunks(const Tensor& x, const Tensor& full, int k,
                                         const dist::ProcessGroupPtr& group) {
  const int64_t mc = x.size(0) / k;
  std::vector<dist::WorkPtr> works;
  for (int c = 0; c < k; ++c)
    works.push_back(group->all_gather(own_rows(x, mc, c), gathered_chunk(full, group->size(), mc, c)));
  return works;
}

// A rank's [m, f] rows of a contiguous input, gathered chunk-major: [n m, f].
std::pair<Tensor, std::vector<dist::WorkPtr>> gather_rows(const Tensor& x, int64_t m, int k,
                                                          const dist::ProcessGroupPtr& group) {
  Tensor mine = ops::view(ops::contiguous(x.detach()), {m, x.size(-1)});
  Tensor full = chorus::detail::empty_tensor({group->size() * m, x.size(-1)}, mine.dtype(), mine.device());
  return {full, gather_chunks(mine, full, k, group)};
}

void wait_all(const std::vector<dist::WorkPtr>& works) {
  for (const dist::WorkPtr& w : works) w->wait();
}

// Note [The row-parallel bias on one rank]: the bias rank 0's product carries; zeros on the others.
Tensor bias_on_rank0(const Tensor& b, const dist::ProcessGroupPtr& group) {
  if (group->rank() == 0) return b;
  Tensor z = chorus::detail::empty_tensor(b.sizes(), b.dtype(), b.device());
  z.fill_(0);
  return z;
}

// The backward of a product y = x_full w^T + b whose x_full was all-gathered
// (in k chunks): (dx, this rank's reduce-scattered chunk [m, f] -- undefined
// unless need_dx --, dw, db). Note [Reduce-scatter beside the weight
// gradient]: each chunk's dx_full rows first, their reduce-scatter issued,
// the next chunk's product beside it (Note [Chunked collectives beside the
// products]), then dw and db while the last runs.
std::tuple<Tensor, Tensor, Tensor> gathered_linear_backward(const Tensor& dy_full, const Tensor& x_full,
                                                            const Tensor& w, int64_t m, int k, bool need_dx,
                                                            const dist::ProcessGroupPtr& group) {
  Tensor dx;
  std::vector<dist::WorkPtr> works;
  if (need_dx) {
    const int n = group->size();
    const int64_t mc = m / k;
    const Tensor dy = ops::contiguous(dy_full);
    Tensor dx_full = chorus::detail::empty_tensor({n * m, w.size(1)}, dy.dtype(), dy.device());
    dx = chorus::detail::empty_tensor({m, w.size(1)}, dy.dtype(), dy.device());
    for (int c = 0; c < k; ++c) {
      Tensor rows = gathered_chunk(dx_full, n, mc, c);
      ops::linear_input_grad_into(gathered_chunk(dy, n, mc, c), w, rows);
      works.push_back(group->reduce_scatter(rows, own_rows(dx, mc, c), dist::ReduceOp::Sum));
    }
  }
  auto [unused, dw, db] = ops::linear_bias_backward(dy_full, x_full, w, /*need_dx=*/false);
  wait_all(works);
  return {dx, dw, db};
}

// The row-parallel side's output gradient g [m, out] gathered chunk-major
// into [n m, out], and (need_dx) dx = g_full w, each chunk's product beside
// the next chunk's gather (Note [Chunked collectives beside the products]).
std::pair<Tensor, Tensor> gather_grad_and_dx(const Tensor& g, const Tensor& w, int64_t m, int k, bool need_dx,
                                             const dist::ProcessGroupPtr& group) {
  auto [g_full, works] = gather_rows(g, m, k, group);
  if (!need_dx) {
    wait_all(works);
    return {g_full, Tensor()};
  }
  const int n = group->size();
  const int64_t mc = m / k;
  Tensor dx = chorus::detail::empty_tensor({n * m, w.size(1)}, g_full.dtype(), g_full.device());
  for (int c = 0; c < k; ++c) {
    works[static_cast<size_t>(c)]->wait();
    ops::linear_input_grad_into(gathered_chunk(g_full, n, mc, c), w, gathered_chunk(dx, n, mc, c));
  }
  return {g_full, dx};
}

}  // namespace

Tensor gather_linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const dist::ProcessGroupPtr& group,
                     int chunks) {
  if (!is_parallel(group)) return nn::functional::linear(x, weight, bias);
  const int n = group->size();
  const Operands o(x, {weight, bias});
  const Tensor &xx = o.x, &w = o.w[0], &b = o.w[1];
  if (!(x.dim() == 3 && w.dim() == 2 && xx.size(2) == w.size(1) && o.uniform()))
    return nn::functional::linear(
        rank_major_to_chunk_major(gather_from_sp(x.contiguous(), group, 0), n, chunks), weight, bias);
  const int64_t batch = xx.size(0), rows = xx.size(1), m = batch * rows;
  const int k = effective_chunks(chunks, m);
  const int64_t mc = m / k;
  auto [full, works] = gather_rows(xx, m, k, group);  // [n m, in], chunk-major
  Tensor wd = w.detach(), bd = b.detach();
  Tensor y = chorus::detail::empty_tensor({n * m, w.size(0)}, full.dtype(), full.device());
  for (int c = 0; c < k; ++c) {
    works[static_cast<size_t>(c)]->wait();  // chunk c+1's gather runs beside this product
    ops::linear_bias_into(gathered_chunk(full, n, mc, c), wd, bd, gathered_chunk(y, n, mc, c));
  }
  y = ops::view(y, {n * batch, rows, w.size(0)});
  const bool need_dx = xx.requires_grad();
  const Shape x_shape = xx.sizes();
  return autograd::record("GatherLinearBackward", y, {xx, w, b}, [full, wd, group, x_shape, m, k, need_dx](const TensorList& g) {
    Tensor g2 = ops::view(ops::contiguous(g[0]), {full.size(0), wd.size(0)});
    auto [dx, dw, db] = gathered_linear_backward(g2, full, wd, m, k, need_dx, group);
    return TensorList{dx.defined() ? ops::view(dx, x_shape) : Tensor(), dw, db};
  });
}

Tensor linear_reduce_scatter(const Tensor& x, const Tensor& weight, const Tensor& bias,
                             const dist::ProcessGroupPtr& group, int chunks) {
  CHORUS_CHECK(is_parallel(group) && bias.defined(), "linear_reduce_scatter: needs a group of 2+ ranks and a bias");
  const int n = group->size();
  const Operands o(x, {weight, bias});
  const Tensor &xx = o.x, &w = o.w[0], &b = o.w[1];
  if (!(x.dim() == 3 && w.dim() == 2 && xx.size(2) == w.size(1) && xx.size(0) % n == 0 && o.uniform()))
    return chorus::add(
        reduce_scatter_to_sp(chunk_major_to_rank_major(nn::functional::linear(x, weight, Tensor()), n, chunks), group, 0),
        copy_param_to_tp(bias, group));
  const int64_t rows = xx.size(1), batch = xx.size(0) / n, m = batch * rows;
  const int k = effective_chunks(chunks, m);
  const int64_t mc = m / k;
  Tensor x2 = ops::view(ops::contiguous(xx.detach()), {n * m, xx.size(2)});
  Tensor wd = w.detach(), b0 = bias_on_rank0(b.detach(), group);
  Tensor partial = chorus::detail::empty_tensor({n * m, w.size(0)}, x2.dtype(), x2.device());
  Tensor y = chorus::detail::empty_tensor({m, w.size(0)}, x2.dtype(), x2.device());
  std::vector<dist::WorkPtr> works;
  for (int c = 0; c < k; ++c) {  // chunk c's reduce-scatter runs beside chunk c+1's product
    Tensor part = gathered_chunk(partial, n, mc, c);
    ops::linear_bias_into(gathered_chunk(x2, n, mc, c), wd, b0, part);
    works.push_back(group->reduce_scatter(part, own_rows(y, mc, c), dist::ReduceOp::Sum));
  }
  wait_all(works);
  y = ops::view(y, {batch, rows, w.size(0)});
  const bool need_dx = xx.requires_grad();
  const Shape x_shape = xx.sizes();
  return autograd::record("LinearReduceScatterBackward", y, {xx, w, b}, [x2, wd, group, x_shape, m, k, need_dx](const TensorList& g) {
    auto [g_full, dx] = gather_grad_and_dx(g[0], wd, m, k, need_dx, group);  // [n m, out], [n m, in]
    auto [unused, dw, db] = ops::linear_bias_backward(g_full, x2, wd, /*need_dx=*/false);
    return TensorList{dx.defined() ? ops::view(dx, x_shape) : Tensor(), dw, db};
  });
}

Tensor sp_mlp(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2,
              const dist::ProcessGroupPtr& group, int chunks) {
  CHORUS_CHECK(is_parallel(group), "sp_mlp: needs a group of 2+ ranks");
  const Operands o(x, {w1, b1, w2, b2});
  const Tensor &xx = o.x, &a = o.w[0], &ab = o.w[1], &c = o.w[2], &cb = o.w[3];
  if (!(x.dim() == 3 && x.numel() > 0 && a.dim() == 2 && c.dim() == 2 && xx.size(2) == a.size(1) &&
        c.size(1) == a.size(0) && o.uniform())) {
    Tensor h = nn::functional::gelu(gather_linear(x, w1, b1, group, chunks), /*tanh_approximation=*/true);
    return linear_reduce_scatter(h, w2, b2, group, chunks);
  }
  const int n = group->size();
  const int64_t batch = xx.size(0), rows = xx.size(1), m = batch * rows;
  const int k = effective_chunks(chunks, m);
  const int64_t mc = m / k;
  auto [full, gathers] = gather_rows(xx, m, k, group);  // [n m, C], chunk-major
  Tensor ad = a.detach(), abd = ab.detach(), cd = c.detach(), cb0 = bias_on_rank0(cb.detach(), group);
  const auto rows_of = [&](int64_t cols) { return chorus::detail::empty_tensor({n * m, cols}, full.dtype(), full.device()); };
  Tensor partial = rows_of(cd.size(0)), pre = rows_of(ad.size(0)), h = rows_of(ad.size(0));
  Tensor y = chorus::detail::empty_tensor({m, cd.size(0)}, full.dtype(), full.device());
  std::vector<dist::WorkPtr> scatters;
  for (int i = 0; i < k; ++i) {
    // Chunk i+1's gather and chunk i-1's reduce-scatter run beside chunk i's products.
    gathers[static_cast<size_t>(i)]->wait();
    Tensor part = gathered_chunk(partial, n, mc, i);
    ops::mlp_gelu_into(gathered_chunk(full, n, mc, i), ad, abd, cd, cb0, part, gathered_chunk(pre, n, mc, i),
                       gathered_chunk(h, n, mc, i));
    scatters.push_back(group->reduce_scatter(part, own_rows(y, mc, i), dist::ReduceOp::Sum));
  }
  wait_all(scatters);
  y = ops::view(y, {batch, rows, cd.size(0)});
  const bool need_dx = xx.requires_grad();
  const Shape x_shape = xx.sizes();
  return autograd::record(
      "SpMlpBackward", y, {xx, a, ab, c, cb}, [full, ad, cd, pre, h, group, x_shape, m, k, need_dx](const TensorList& g) {
        auto [g_full, unused_dx] = gather_grad_and_dx(g[0], cd, m, k, /*need_dx=*/false, group);
        auto [dpre, dw2, db2] = ops::mlp_gelu_backward_second(g_full, cd, pre, h);
        auto [dx, dw1, db1] = gathered_linear_backward(dpre, full, ad, m, k, need_dx, group);
        return TensorList{dx.defined() ? ops::view(dx, x_shape) : Tensor(), dw1, db1, dw2, db2};
      });
}

}  // namespace chorus::tp
