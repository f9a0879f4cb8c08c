// Graph nodes of the define-by-run autograd. A Node maps the gradients of its
// forward op's outputs to the gradients of its inputs; edges point to the nodes
// that produced those inputs (or to a leaf's AccumulateGrad).
//
// Note [Saved tensors are freed after backward]: a node releases what it saved
// once backward has run through it (unless retain_graph), and running backward
// through it again raises an error that says so, as PyTorch does.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "chorus/core/tensor.h"

namespace chorus::autograd {

class Node;

struct Edge {
  std::shared_ptr<Node> fn;  // null: this input needs no gradient
  uint32_t input_nr = 0;
};

// Where an input's gradient must end up (the engine converts to it).
struct InputMeta {
  Device device;
  DType dtype;
  Shape shape;
};

class Node {
 public:
  virtual ~Node() = default;
  // grads[i] is the gradient of output i (undefined if that output got none).
  virtual TensorList apply(TensorList&& grads) = 0;
  virtual std::string name() const = 0;
  virtual void release_saved() {}
  virtual bool is_accumulate_grad() const { return false; }
  // Whether apply() orders its own reads of gradients computed beside the data
  // gradient (Note [Weight gradients beside the data gradient]); otherwise the
  // engine makes the current stream wait for them before apply().
  virtual bool orders_beside_reads() const { return false; }
  // The leaf an AccumulateGrad node adds into (nullptr for other nodes).
  virtual const TensorImpl* accumulated_leaf() const { return nullptr; }

  std::vector<Edge> next;
  std::vector<InputMeta> input_meta;
  uint32_t num_outputs = 1;
  Device device;
  uint64_t seq = 0;  // creation order; later nodes run first among ready ones
  // Whether apply() may take gradient addends (Note [Gradient addends]).
  bool takes_addends = false;
};

// Note [Gradient addends]: where a tensor feeds two ops (a residual block's
// input: the identity path and the first batch norm), its gradient is the sum
// of two, and the engine added them with a kernel of its own: in WRN-28-10 a
// dozen adds of a whole activation's gradient per step (H100, bf16; benchmarks
// journal, session 12). A node with takes_addends set is offered, while its
// apply() runs, the gradient already waiting where its input i's gradient goes
// (only when that slot expects exactly two gradients, one of them pending, so
// the sum is the same whichever arrives first: two addends commute exactly);
// a node that takes it returns, for input i, its own gradient plus the addend,
// computed in its kernel (batch norm's backward adds it before rounding to the
// gradient's dtype, one rounding fewer in bf16). An addend not taken goes back
// to its slot untouched.
//
// Inside Node::apply: the addend offered for input i (taking it is the promise
// above), or an undefined tensor.
Tensor take_gradient_addend(size_t input);

// Inside Node::apply: whether this backward pass keeps the graph
// (retain_graph), so that the node may run again. A node that does not
// may write its gradient into a tensor it saved (the fused classifier scales
// its saved gradient in place) since nothing reads that tensor after it.
bool backward_keeps_graph();

using BackwardFn = std::function<TensorList(const TensorList& grad_outputs)>;

// A node whose backward is a closure over the tensors it saved.
class FunctionNode final : public Node {
 public:
  FunctionNode(std::string name, BackwardFn fn) : name_(std::move(name)), fn_(std::move(fn)) {}
  TensorList apply(TensorList&& grads) override;
  std::string name() const override { return name_; }
  void release_saved() override { fn_ = nullptr; }

 private:
  std::string name_;
  BackwardFn fn_;
};

// Adds incoming gradients into a leaf's .grad(), then runs its hooks.
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(std::shared_ptr<TensorImpl> leaf) : leaf_(std::move(leaf)) {}
  TensorList apply(TensorList&& grads) override;
  std::string name() const override { return "AccumulateGrad"; }
  bool is_accumulate_grad() const override { return true; }
  const TensorImpl* accumulated_leaf() const override { return leaf_.get(); }

 private:
  std::shared_ptr<TensorImpl> leaf_;
};

// The edge that a gradient for `t` should flow along.
Edge gradient_edge(const Tensor& t);

// The next creation number for Node::seq. record() uses it; code that builds
// its own Node subclasses (parallel::DataParallel) must too, so that the
// engine's ordering (later nodes first, gradients summed in creation order)
// covers them.
uint64_t next_sequence_nr();
// A creation number that puts a node ahead of every ordinary node once it is
// ready (still unique and increasing, so that sums stay in a fixed order): for
// nodes that start communication which the rest of the backward pass should
// overlap, such as DataParallel's per-bucket gradient reductions.
uint64_t next_urgent_sequence_nr();

// Records `outputs` as produced by a differentiable op of `inputs` when grad
// mode is on and any input requires grad; returns the outputs. The backward
// closure receives one gradient per output (undefined ones replaced by zeros
// when `zero_fill` is set) and returns one per input (undefined = none).
TensorList record(const char* name, TensorList outputs, const TensorList& inputs, BackwardFn backward);
Tensor record(const char* name, Tensor output, const TensorList& inputs, BackwardFn backward);
bool any_requires_grad(const TensorList& inputs);

}  // namespace chorus::autograd
