// Gradient clipping by the global norm (torch.nn.utils.clip_grad_norm_): the
// 2-norm of all gradients together, and every gradient scaled by
// min(1, max_norm / (norm + 1e-6)). On the devices, with no host wait, so it
// can sit inside a captured step. Under DDP the gradients are already the
// ranks' average when the backward returns, so each rank computes the same
// norm: the whole model's.
#pragma once

#include <vector>

#include "chorus/core/tensor.h"

namespace chorus::optim {

// Returns the norm before clipping (float32 [] on the first gradient's device;
// float64 when the gradients are). Parameters without a gradient are skipped.
// max_norm <= 0 or infinite: the norm is computed and nothing is scaled.
Tensor clip_grad_norm_(const std::vector<Tensor>& params, double max_norm);


}  // namespace chorus::optim
