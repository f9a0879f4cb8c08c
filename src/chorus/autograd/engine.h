// The backward engine: runs the graph behind a root tensor in dependency order.
#pragma once

#include "chorus/core/tensor.h"

namespace chorus::autograd {

// Computes gradients of `root` (seeded with `grad`, or ones for a scalar) and
// accumulates them into the leaves' .grad(). Each node runs under a
// DeviceGuard for its forward op's device; GPU work is only enqueued, so a
// graph spanning several GPUs keeps all of them busy.
void run_backward(const Tensor& root, const Tensor& grad, bool retain_graph);

}  // namespace chorus::autograd
