// Backward observers: code that must act at the start and at the end of every
// backward pass over its parameters -- DistributedDataParallel's reducer --
// without the user calling anything.
//
// Note [Backward observers]: run_backward first walks the graph to count each
// node's dependencies; that walk also meets every AccumulateGrad node, i.e.
// every leaf the pass will reach. When observers are registered, the engine
// collects those leaves during the walk (no second traversal: PyTorch's
// find_unused_parameters walks the graph again from the outputs every step),
// calls begin() with them before any node runs, and end() after the last node
// ran -- on the thread that called backward, also when the pass failed. A
// leaf that is reached can still get no gradient (a backward formula that
// returns none for it): end() is where an observer finds that out.
// With no observer registered the engine does none of this.
#pragma once

#include <memory>
#include <unordered_set>

#include "chorus/core/tensor.h"

namespace chorus::autograd {

class BackwardObserver {
 public:
  virtual ~BackwardObserver() = default;
  // `leaves`: the leaves whose AccumulateGrad this pass reaches.
  virtual void begin(const std::unordered_set<const TensorImpl*>& leaves) = 0;
  // After the pass; ok is false when a node threw (the error then propagates).
  virtual void end(bool ok) = 0;
};

// Registers `observer` (held weakly) until the returned handle is destroyed.
std::shared_ptr<void> add_backward_observer(std::weak_ptr<BackwardObserver> observer);

namespace detail {
// The engine's side: the live observers (empty when none is registered).
std::vector<std::shared_ptr<BackwardObserver>> live_backward_observers();
}  // namespace detail

}  // namespace chorus::autograd
