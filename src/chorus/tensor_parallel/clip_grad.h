// Gradient clipping by the global norm of a model split over a mesh: the
// 2-norm of the whole tp=1 model's gradient, the same number on every rank.
// Each tensor rank adds the squares of its shards' gradients and, on tensor
// rank 0 only, of the replicated parameters' (whose gradients every tensor
// rank holds whole and equal); one all-reduce over the tensor group sums
// them. Under pipeline parallelism `params` are this rank's stages' and a
// second all-reduce over the pipeline group adds the stages' sums; a tensor
// two stages hold (the tied embedding: Note [Tied embeddings across stages])
// is counted on one of them only (`counted_elsewhere` on the others). The
// data-parallel axis needs nothing: after DDP's averaging every data rank
// holds the same gradients.
#pragma once

#include <vector>

#include "chorus/core/tensor.h"
#include "chorus/distributed/process_group.h"
#include "chorus/tensor_parallel/shard.h"

namespace chorus::tp {

// As optim::clip_grad_norm_: every gradient scaled by
// min(1, max_norm / (norm + 1e-6)); returns the norm before clipping
// (float64 for float64 gradients, float32 otherwise). max_norm <= 0: the norm
// only. Collective over `tp_group`, then `pp_group` when given.
Tensor clip_grad_norm_(const std::vector<ShardedParameter>& params, double max_norm,
                       const dist::ProcessGroupPtr& tp_group, const dist::ProcessGroupPtr& pp_group = nullptr,
                       const std::vector<Tensor>& counted_elsewhere = {});

}  // namespace chorus::tp
