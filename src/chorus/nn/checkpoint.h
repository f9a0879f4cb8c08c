// Activation recomputation (checkpointing; Chen et al. 2016,
// torch.utils.checkpoint): a module's forward runs without recording, only
// its input is kept, and its backward runs the forward again -- with the same
// random numbers -- to compute the gradients. Memory for the activations of
// one block instead of all of them, for a third more compute.
#pragma once

#include "chorus/nn/module.h"

namespace chorus::nn {

// m.forward(x) whose activations are recomputed in the backward. The
// gradients of x and of m's parameters equal an ordinary forward's (the
// recomputed forward draws the same dropout masks). m must outlive the
// backward pass and keep its parameters until then. Outside grad mode (or
// when nothing requires grad) it is m.forward(x).
Tensor checkpoint(Module& m, const Tensor& x);

}  // namespace chorus::nn
