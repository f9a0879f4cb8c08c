// Gradient finishers (Note [Gradient finishers]): how a gradient that does
// not yet hold its whole value, or that may be kept where it is, says so --
// one generic slot on the autograd metadata (AutogradMeta::finisher) instead
// of fields for each variant in the tensor type.
//
// Note [Gradient finishers]: a gradient can leave the backward unfinished.
// DataParallel's replicas over two GPUs exchange their gradients and leave
// the sum to the optimizer's fused update, which adds the other GPU's part as
// it reads the gradient, one float addition per element (Note [Gradient sums
// in the update] in data_parallel/reducer.h); and a gradient that is a view of a
// reduced bucket owns its elements of the shared buffer, so it can be kept as
// .grad without a copy (PyTorch's gradient_as_bucket_view). The finisher on a
// gradient says both: finish() makes the gradient whole, and everything that
// reads a gradient's values other than a fused update runs it first --
// Tensor::grad(), AccumulateGrad accumulating into an earlier gradient, the
// engine summing two gradients of one input or moving one to another device
// or dtype -- so no reader sees half a sum; pending() lets a fused update add
// the part itself; owns_elements() lets AccumulateGrad keep the view.
#pragma once

#include <memory>

#include "chorus/core/tensor.h"

namespace chorus::autograd {

class GradFinisher {
 public:
  virtual ~GradFinisher() = default;
  // Makes `grad` hold its whole value (in place, on the current stream);
  // once: a finished gradient's later calls do nothing. Called under no lock
  // by whoever reads first; calls from several threads must finish once.
  virtual void finish(const Tensor& grad) = 0;
  // What finish() would add to the gradient (same sizes, strides, dtype,
  // device), left pending, for an update that adds it as it reads the
  // gradient; undefined when nothing is pending.
  virtual Tensor pending() const { return Tensor(); }
  // Whether the gradient, a view of a buffer others share, owns its elements
  // (nobody else reads or writes them): it may be kept as a leaf's .grad.
  virtual bool owns_elements() const { return false; }
};

// t's finisher (null: none). set_grad_finisher replaces it (null: removes).
std::shared_ptr<GradFinisher> grad_finisher(const Tensor& t);
void set_grad_finisher(const Tensor& t, std::shared_ptr<GradFinisher> finisher);

// Makes t hold its whole value: runs its finisher, if any. No-op for an
// undefined tensor. Finish a tensor from the thread (and stream) that goes on
// to read it.
void finish_grad(const Tensor& t);
// What finishing t would add (undefined: nothing pending).
Tensor pending_part(const Tensor& t);
// Whether t owns its elements of a shared buffer (GradFinisher::owns_elements).
bool owns_elements(const Tensor& t);
// The leaf's .grad as it is, unfinished (Tensor::grad() finishes it): for the
// optimizer, which adds a pending part in its update.
Tensor unfinished_grad(const Tensor& leaf);

// The library's finisher for a gradient plus a pending part (Note [Gradient
// sums in the update]). set_pending_sum gives `part` (same sizes, strides,
// dtype and device as t) to t; ValueError if it does not match or t already
// has one pending. During a graph capture, the part is given again after each
// replay (Note [Pending sums in a captured step]). mark_owned_view marks a
// view as owning its elements (a pending part given later keeps the mark).
void set_pending_sum(const Tensor& t, const Tensor& part);
void mark_owned_view(const Tensor& t);

}  // namespace chorus::autograd
