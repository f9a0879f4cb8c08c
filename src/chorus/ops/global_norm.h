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

// clip_by_global_norm_ with the gradients left as they are: the norm and the
// scale min(1, max_norm / (norm + 1e-6)) ([] in `acc` on `home`; undefined
// when max_norm <= 0 or infinite), for a fused update to apply as it reads
// them (Note [Clipping in the update] in optim/clip_grad.h).
struct NormAndScale {
  Tensor norm, scale;
};
NormAndScale global_norm_and_scale(const TensorList& grads, double max_norm, const Device& home, DType acc,
                                   const std::function<void(const Tensor&)>& total_of = {});

// Every xs[i] *= scale in place (a one-element float32 or float64 tensor on
// any device: copied to each tensor's), as clip_by_global_norm_ scales: one
// multi-tensor pass per device for the contiguous ones.
void scale_by_(const TensorList& xs, const Tensor& scale);

}  // namespace chorus::ops
