// Gradient clipping by the global norm of a model split over a mesh: the
// 2-norm of the whole tp=1 model's gradient, the same number on every rank.
// Each tensor rank adds the squares of its shards' gradients and, on tensor
// rank 0 only, of the replicated parameters' (whose gradients every tensor
// rank holds whole and equal); one all-reduce over the tensor group sums
// them. The data-parallel axis needs nothing: after DDP's averaging every
// data rank holds the same gradients.
#pragma once

#include <vector>

#include "chorus/core/tensor.h"
#include "chorus/dist/process_group.h"
#include "chorus/tensor_parallel/shard.h"

namespace chorus::tp {

// As optim::clip_grad_norm_: every gradient scaled by
// min(1, max_norm / (norm + 1e-6)); returns the norm before clipping
// (float64 for float64 gradients, float32 otherwise). max_norm <= 0: the norm
// only. Collective over `tp_group`.
Tensor clip_grad_norm_(const std::vector<ShardedParameter>& params, double max_norm,
                       const dist::ProcessGroupPtr& tp_group);

}  // namespace chorus::tp
