// Gradient clipping by the global norm (torch.nn.utils.clip_grad_norm_): the
// 2-norm of all gradients together, and every gradient scaled by
// min(1, max_norm / (norm + 1e-6)). On the devices, with no host wait, so it
// can sit inside a captured step. Under DDP the gradients are already the
// ranks' average when the backward returns, so each rank computes the same
// norm: the whole model's.
#pragma once

#include <functional>
#include <vector>

#include "chorus/core/tensor.h"

namespace chorus::optim {

// Returns the norm before clipping (float32 [] on the first gradient's device;
// float64 when the gradients are). Parameters without a gradient are skipped.
// max_norm <= 0 or infinite: the norm is computed and nothing is scaled.
Tensor clip_grad_norm_(const std::vector<Tensor>& params, double max_norm);

// The same where the gradients are sharded (dist::ShardedDataParallel): the
// sum of squares of this process's gradients goes through `total_of` (an
// all-reduce over the ranks, in place) before the square root, so every rank
// scales by the whole model's norm. An empty `params` (no gradient here)
// contributes 0: every rank must call it.
Tensor clip_grad_norm_sharded_(const std::vector<Tensor>& params, double max_norm, const Device& home, DType acc,
                               const std::function<void(const Tensor& sum_of_squares)>& total_of);

}  // namespace chorus::optim
