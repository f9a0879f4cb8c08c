// Gradients with a sum still to do (Note [Gradient sums in the update] in
// dist/reducer.h): a DataParallel gradient whose other GPU's part was copied
// beside it, to be added by the optimizer's update as it reads both.
#pragma once

#include "chorus/core/tensor.h"

namespace chorus::autograd {

// Makes t hold its whole value: adds its pending part in place (one kernel on
// t's device, on the current stream) and forgets it. No-op for an undefined
// tensor or one with nothing pending. Calls from several threads add the part
// once, but a second caller may return before the first has issued the add:
// settle a tensor from the thread (and stream) that goes on to read it.
void settle_sum(const Tensor& t);

// What settle_sum would add to t (undefined if nothing), left pending: for a
// fused update that adds it as it reads t.
Tensor pending_sum(const Tensor& t);

// The leaf's .grad as it is, pending part included (Tensor::grad() settles
// it): for the optimizer, which adds the part in its update.
Tensor unsettled_grad(const Tensor& leaf);

// Gives `part` (same sizes, strides, dtype and device as t) to t as pending.
// ValueError if it does not match or t already has one. During a graph
// capture, also after each replay (Note [Pending sums in a captured step]).
void set_pending_sum(const Tensor& t, const Tensor& part);

}  // namespace chorus::autograd
