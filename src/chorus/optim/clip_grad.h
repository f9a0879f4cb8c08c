// Gradient clipping by the global norm (torch.nn.utils.clip_grad_norm_): the
// 2-norm of all gradients together, and every gradient scaled by
// min(1, max_norm / (norm + 1e-6)). On the devices, with no host wait, so it
// can sit inside a captured step. Under DDP the gradients are already the
// ranks' average when the backward returns, so each rank computes the same
// norm: the whole model's.
//
// Note [Clipping in the update]: clip_grad_norm_ then a step reads and
// writes every gradient once more than the update needs -- a pass of its own
// for the scale. clip_grad_norm_scale computes the same norm and scale and
// leaves the gradients alone; Optimizer::step_scaled hands the scale (a
// device tensor, so a captured step replays with each step's own) to the
// update, and AdamW's fused kernel multiplies each gradient by it as it
// reads it: the same float product the in-place pass would have stored, so
// the update is the same to the bit (llm.c folds its clipping into AdamW the
// same way). Two things differ from clip_grad_norm_ then step(): the
// gradients keep their unscaled values (use clip_grad_norm_ where something
// reads them after the step), and optimizers without a fused path
// (Optimizer's default step_scaled, SGD) scale them in place as before.
#pragma once

#include <vector>

#include "chorus/core/tensor.h"
#include "chorus/optim/optimizer.h"

namespace chorus::optim {

// Returns the norm before clipping (float32 [] on the first gradient's device;
// float64 when the gradients are). Parameters without a gradient are skipped.
// max_norm <= 0 or infinite: the norm is computed and nothing is scaled.
Tensor clip_grad_norm_(const std::vector<Tensor>& params, double max_norm);

// clip_grad_norm_ without the scaling: the norm, and the scale
// min(1, max_norm / (norm + 1e-6)) to pass to Optimizer::step_scaled (both []
// on the first gradient's device, float32, float64 when the gradients are;
// the scale undefined when max_norm <= 0 or infinite).
struct ClipScale {
  Tensor norm, scale;
};
ClipScale clip_grad_norm_scale(const std::vector<Tensor>& params, double max_norm);

// clip_grad_norm_(params, max_norm) then opt.step(), the scale folded into
// the update (Note [Clipping in the update]); returns the norm before
// clipping. `params`: those whose gradients count in the norm (opt's own).
Tensor clip_and_step(Optimizer& opt, const std::vector<Tensor>& params, double max_norm);

}  // namespace chorus::optim
