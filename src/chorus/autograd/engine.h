// The backward engine: runs the graph behind a root tensor in dependency order.
#pragma once

#include "chorus/core/tensor.h"

namespace chorus::autograd {

// Computes gradients of `root` (seeded with `grad`, or ones for a scalar) and
// accumulates them into the leaves' .grad(). Each node runs under a
// DeviceGuard for its forward op's device; GPU work is only enqueued, so a
// graph spanning several GPUs keeps all of them busy.
void run_backward(const Tensor& root, const Tensor& grad, bool retain_graph);

// Note [Several roots]: one backward pass from several tensors at once, each
// seeded with its gradient (grads empty: ones, for tensors of one element), as
// torch.autograd.backward(tensors) does. A leaf reached from several roots
// gets the sum; a root that another root's graph reaches gets its seed plus
// what flows into it. Roots on different devices start at once, each on its
// own device's thread, with no gradient crossing devices to start them: that
// is how DataParallel's per-replica losses (parallel::ReplicaLosses) begin
// every replica's backward without waiting for the others.
void run_backward(const TensorList& roots, const TensorList& grads, bool retain_graph);

}  // namespace chorus::autograd
