// Clipping a set of gradients by their global 2-norm: the arithmetic behind
// optim::clip_grad_norm_ (one process, or DDP, whose gradients are the same
// on every rank) and dist::ShardedDataParallel::clip_grad_norm (each rank
// holds a shard: `total_of` all-reduces the sum of squares first).
#pragma once

#include <functional>

#include "chorus/core/tensor.h"

namespace chorus::ops {

// norm = sqrt(total_of(sum of the squares of every element of `grads`)),
// and every gradient scaled in place by min(1, max_norm / (norm + 1e-6)), as
// PyTorch; returns the norm before clipping ([] in `acc` on `home`). On the
// devices, no host wait (Note [Clipping in a few launches]). `total_of`, when
// set, turns this process's sum of squares (in place) into the total over
// the processes that hold the other gradients. `grads` may be empty (this
// process contributes 0). max_norm <= 0 or infinite: the norm only.
Tensor clip_by_global_norm_(const TensorList& grads, double max_norm, const Device& home, DType acc,
                            const std::function<void(const Tensor&)>& total_of = {});

}  // namespace chorus::ops
