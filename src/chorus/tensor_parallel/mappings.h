// The communication of tensor parallelism as autograd functions, after
// Megatron-LM's mappings.py: each is a collective in one direction and its
// conjugate in the other, so the parallel layers compose them and the
// backward pass needs no code of its own.
//
//   copy_to_tp        f: identity forward, all-reduce (sum) of the gradient backward
//   reduce_from_tp    g: all-reduce (sum) forward, identity backward
//   gather_from_tp    all-gather along `dim` forward, own chunk of the gradient backward
//   gather_from_sp    sequence parallel: all-gather along `dim` forward, reduce-scatter backward
//   reduce_scatter_to_sp  reduce-scatter along `dim` forward, all-gather backward
//
// Every collective is issued on `group` and waited for (Gloo: on the host;
// NCCL: ordered on the stream); the group's timeout bounds each one. Ranks
// must call these in the same order, which a model whose forward is the same
// on every rank of the group gives (the backward walks the same graph).
// A group of one rank, or a null group, makes each of them the identity.
#pragma once

#include "chorus/core/tensor.h"
#include "chorus/distributed/process_group.h"

namespace chorus::tp {

using dist::ProcessGroupPtr;

Tensor copy_to_tp(const Tensor& x, const ProcessGroupPtr& group);
// copy_to_tp for a parameter (a leaf): its gradient's all-reduce is issued
// and finished by whoever reads the gradient first (Note [Replicated
// gradients summed in the background]).
Tensor copy_param_to_tp(const Tensor& p, const ProcessGroupPtr& group);
Tensor reduce_from_tp(const Tensor& x, const ProcessGroupPtr& group);
Tensor gather_from_tp(const Tensor& x, const ProcessGroupPtr& group, int64_t dim);
Tensor gather_from_sp(const Tensor& x, const ProcessGroupPtr& group, int64_t dim);
Tensor reduce_scatter_to_sp(const Tensor& x, const ProcessGroupPtr& group, int64_t dim);

// The plain collectives the functions above are made of (no autograd):
// the ranks' `x` concatenated along `dim`; this rank's chunk along `dim` of
// the sum of the ranks' `x` (x.size(dim) divisible by the group's size).
Tensor all_gather_along(const Tensor& x, const ProcessGroupPtr& group, int64_t dim);
Tensor reduce_scatter_along(const Tensor& x, const ProcessGroupPtr& group, int64_t dim);
// In place sum over the group (no autograd).
void all_reduce_sum(const Tensor& x, const ProcessGroupPtr& group);

inline bool is_parallel(const ProcessGroupPtr& group) { return group && group->size() > 1; }

}  // namespace chorus::tp
