#include "chorus/tensor_parallel/cross_entropy.h"

#include <algorithm>
#include <limits>

#include "chorus/autograd/grad_mode.h"
#include "chorus/autograd/node.h"
#include "chorus/core/error.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/elementwise.h"
#include "chorus/ops/factory.h"
#include "chorus/ops/indexing.h"
#include "chorus/tensor_parallel/mappings.h"

namespace chorus::tp {

Tensor vocab_parallel_cross_entropy(const Tensor& local_logits, const Tensor& targets, int64_t vocab,
                                    const dist::ProcessGroupPtr& group, std::optional<int64_t> ignore_index) {
  CHORUS_CHECK(local_logits.defined() && targets.defined() && local_logits.dim() == targets.dim() + 1,
               "vocab_parallel_cross_entropy: logits ", local_logits.describe(), " must have one dim more than the targets ",
               targets.describe());
  for (int64_t d = 0; d < targets.dim(); ++d)
    CHORUS_CHECK(local_logits.size(d) == targets.size(d), "vocab_parallel_cross_entropy: logits ",
                 shape_str(local_logits.sizes()), " do not match targets ", shape_str(targets.sizes()));
  CHORUS_CHECK(targets.dtype() == kInt64 || targets.dtype() == kInt32,
               "vocab_parallel_cross_entropy: targets must be integers, got ", targets.describe());
  const int64_t vl = local_logits.size(-1), n = targets.numel();
  const int ranks = is_parallel(group) ? group->size() : 1, rank = is_parallel(group) ? group->rank() : 0;
  CHORUS_CHECK(vocab >= 1 && vocab <= vl * ranks, "vocab_parallel_cross_entropy: vocabulary ", vocab,
               " does not fit the ", vl * ranks, " columns of the ", ranks, " ranks' logits");
  const int64_t start = rank * vl;
  // The columns of this rank that are real tokens: the padding columns sit at
  // the end of the vocabulary, so they are a tail of the last ranks' slices.
  const int64_t valid = std::clamp<int64_t>(vocab - start, 0, vl);
  const Device dev = local_logits.device();
  const DType acc = local_logits.dtype() == kFloat64 ? kFloat64 : kFloat32;

  // The forward on detached values (the record below is its graph node).
  // Note [Vocabulary-parallel loss in place]: the logits are the largest
  // tensor of the step ([rows, vocabulary / tp]); every pass over them costs.
  // One float copy of this rank's real columns is made and the passes work in
  // it in place -- shift by the row maximum, exponentiate, and in the
  // backward scale into the gradient and subtract the target's one-hot with a
  // scatter -- instead of a new tensor for each step and a dense one-hot.
  std::optional<NoGradGuard> no_grad(std::in_place);
  Tensor lg = local_logits.detach().reshape({n, vl});
  Tensor tg = targets.reshape({n}).to(dev, kInt64);
  Tensor work;  // [n, valid] in `acc`, our own: the shifted logits, then their exponentials
  if (valid > 0) {
    work = ops::to_dtype(lg.narrow(1, 0, valid), acc).contiguous();
    if (work.storage().get() == lg.storage().get()) work = ops::clone(work);
  }

  // 1. Each row's maximum over the whole vocabulary (for a stable exp).
  Tensor row_max = valid > 0 ? work.max(1, false).contiguous()
                             : full({n}, -std::numeric_limits<double>::infinity(), {acc, dev});
  if (is_parallel(group)) group->all_reduce(row_max, dist::ReduceOp::Max)->wait();

  // 2. exp(logit - max) over the local columns, and the target's shifted logit
  //    where this rank holds the target's column (0 elsewhere).
  Tensor in_range = tg.ge(full({}, double(start), {kInt64, dev})).mul(tg.lt(full({}, double(start + valid), {kInt64, dev})));
  Tensor in_range_i = in_range.to(kInt64), in_range_f = in_range.to(acc);
  Tensor local_idx = tg.sub(full({}, double(start), {kInt64, dev})).mul(in_range_i).reshape({n, 1});
  Tensor packed = zeros({2, n}, {acc, dev});
  if (valid > 0) {
    ops::binary_(BinaryOp::Sub, work, row_max.reshape({n, 1}));
    packed.select(0, 1).copy_(ops::gather(work, 1, local_idx).reshape({n}).mul(in_range_f));
    ops::unary_(UnaryOp::Exp, work, 0);
    packed.select(0, 0).copy_(work.sum({1}, false));
  }
  all_reduce_sum(packed, group);
  Tensor sum_exp = packed.select(0, 0).contiguous(), target_shifted = packed.select(0, 1).contiguous();

  // 3. loss = mean over the kept rows of log(sum exp) - target's shifted logit.
  Tensor kept = ignore_index ? tg.ne(full({}, double(*ignore_index), {kInt64, dev})).to(acc) : ones({n}, {acc, dev});
  // The kept rows, at least 1 (an all-ignored batch gives 0, not NaN), on the
  // device: no host wait.
  Tensor count = kept.sum();
  Tensor count1 = count.lt(full({}, 1.0, {acc, dev})).to(acc).add(count);
  // In `acc`, as the fused classifier's loss (float32 for bf16 logits).
  Tensor loss = sum_exp.log().sub(target_shifted).mul(kept).sum().div(count1);

  no_grad.reset();
  const Shape logits_shape = local_logits.sizes();
  const DType logits_dtype = local_logits.dtype();
  return autograd::record(
      "VocabParallelCrossEntropyBackward", loss, {local_logits},
      [work, sum_exp, kept, count1, local_idx, in_range_f, n, vl, valid, acc, dev, logits_shape,
       logits_dtype](const TensorList& g) {
        // d loss / d logit[r, c] = g / count * kept[r] * (softmax[r, c] - onehot[r, c]),
        // on the local columns; the padding columns get none. Written over
        // the saved exponentials unless the graph is kept for another backward.
        if (valid == 0) return TensorList{zeros(logits_shape, {logits_dtype, dev})};
        Tensor grad = autograd::backward_keeps_graph() ? ops::clone(work) : work;
        Tensor scale = kept.mul(ops::to_dtype(g[0], acc).div(count1));  // [n]
        ops::binary_(BinaryOp::Mul, grad, scale.div(sum_exp).reshape({n, 1}));
        ops::scatter_add_(grad, 1, local_idx, scale.mul(in_range_f).neg().reshape({n, 1}));
        if (valid == vl) return TensorList{ops::to_dtype(grad, logits_dtype).reshape(logits_shape)};
        Tensor out = zeros({n, vl}, {logits_dtype, dev});
        out.narrow(1, 0, valid).copy_(grad);
        return TensorList{out.reshape(logits_shape)};
      });
}

}  // namespace chorus::tp
