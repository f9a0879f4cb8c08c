#include "chorus/autograd/node.h"

#include <atomic>
#include <mutex>

#include "chorus/autograd/grad_mode.h"
#include "chorus/autograd/grad_finisher.h"
#include "chorus/autograd/side_work.h"
#include "chorus/core/error.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/elementwise.h"

namespace chorus::autograd {

namespace {
std::atomic<uint64_t> g_seq{0};
}

uint64_t next_sequence_nr() { return g_seq++; }
uint64_t next_urgent_sequence_nr() { return (uint64_t{1} << 63) | g_seq++; }

TensorList FunctionNode::apply(TensorList&& grads) {
  if (!fn_) {
    CHORUS_THROW(ValueError, "backward through ", name_,
                 " a second time: its saved tensors were freed after the first backward. "
                 "Pass retain_graph=true to the first backward() to run it twice.");
  }
  bool any = false;
  for (const Tensor& g : grads) any = any || g.defined();
  if (!any) return {};  // nothing flows through this node
  return fn_(grads);
}

TensorList AccumulateGrad::apply(TensorList&& grads) {
  Tensor leaf(leaf_);
  Tensor g = std::move(grads[0]);
  if (!g.defined()) return {};
  AutogradMeta* meta = leaf_->autograd.get();
  // Note [Weight gradients beside the data gradient]: taking a gradient
  // computed beside as .grad reads nothing; anything else here may, and so may
  // hooks, unless they say they read it later (DDP's buckets).
  if (meta->grad || g.device() != leaf.device() || g.dtype() != leaf.dtype() || meta->reading_hooks > 0)
    join_beside_for(g);
  // Note [Gradient finishers]: a gradient with a pending part is
  // kept as it is, part and all, when it becomes .grad as it came; anything
  // that computes with it adds the part first.
  if (meta->grad || g.device() != leaf.device() || g.dtype() != leaf.dtype()) finish_grad(g);
  g = ops::to_dtype(ops::to_device(g, leaf.device()), leaf.dtype());
  if (!meta->grad) {
    // Own the buffer: the incoming gradient may alias a tensor someone else
    // holds (an add's backward passes one gradient to both inputs), so it is
    // cloned -- unless nobody else can see it: one handle, its own storage,
    // no autograd history. That is the usual case (a fresh result of a
    // backward formula), and taking it saves a copy per parameter per step.
    // A view that owns its elements of a shared buffer (a reduced gradient
    // bucket's: Note [Gradient finishers]) is as good.
    const bool whole = g.storage().use_count() == 1 && g.storage_offset() == 0 &&
                       g.nbytes() == g.storage()->nbytes();
    const AutogradMeta* gm = g.autograd_meta();
    const bool no_history = !gm || (!gm->grad_fn && !gm->requires_grad);
    const bool sole_owner = g.impl_ptr().use_count() == 1 && no_history && (whole || owns_elements(g));
    if (!sole_owner) {
      join_beside_for(g);  // cloned below
      finish_grad(g);
    }
    meta->grad = sole_owner ? g.impl_ptr() : ops::clone(g).impl_ptr();
  } else {
    Tensor old(meta->grad);
    finish_grad(old);
    ops::binary_(BinaryOp::Add, old, g, 1.0);
  }
  for (auto& hook : meta->post_accumulate_hooks) hook(leaf);
  return {};
}

Edge gradient_edge(const Tensor& t) {
  AutogradMeta* m = t.autograd_meta();
  if (!m || !m->requires_grad) return Edge{};
  if (m->grad_fn) return Edge{m->grad_fn, m->output_nr};
  // Replica threads may record ops on one leaf at once: one accumulator per leaf.
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  std::shared_ptr<Node> acc = m->grad_accumulator.lock();
  if (!acc) {
    acc = std::make_shared<AccumulateGrad>(t.impl_ptr());
    // Urgent: a leaf's gradient is final as soon as this node is ready, and
    // whatever waits for it (DDP's bucket all-reduce, through the
    // post-accumulate hook) should start then, not after every other ready
    // node. With the default creation number (0, the oldest) every
    // AccumulateGrad ran last, so all of DDP's buckets went out at the end of
    // the backward and none of the communication overlapped it.
    acc->seq = next_urgent_sequence_nr();
    acc->device = t.device();
    acc->input_meta.push_back({t.device(), t.dtype(), t.sizes()});
    m->grad_accumulator = acc;
  }
  return Edge{acc, 0};
}

bool any_requires_grad(const TensorList& inputs) {
  for (const Tensor& t : inputs)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

TensorList record(const char* name, TensorList outputs, const TensorList& inputs, BackwardFn backward) {
  if (!grad_enabled() || !any_requires_grad(inputs)) return outputs;
  auto node = std::make_shared<FunctionNode>(name, std::move(backward));
  node->seq = next_sequence_nr();
  node->num_outputs = static_cast<uint32_t>(outputs.size());
  node->device = outputs.empty() ? cpu_device(0) : outputs[0].device();
  node->next.reserve(inputs.size());
  node->input_meta.reserve(inputs.size());
  for (const Tensor& in : inputs) {
    node->next.push_back(in.defined() ? gradient_edge(in) : Edge{});
    if (in.defined()) node->input_meta.push_back({in.device(), in.dtype(), in.sizes()});
    else node->input_meta.push_back({cpu_device(0), kFloat32, {}});
  }
  for (uint32_t i = 0; i < outputs.size(); ++i) {
    // Outputs are fresh tensors (or fresh views): give each its own meta.
    outputs[i].set_grad_fn(node, i);
  }
  return outputs;
}

Tensor record(const char* name, Tensor output, const TensorList& inputs, BackwardFn backward) {
  return record(name, TensorList{std::move(output)}, inputs, std::move(backward))[0];
}

}  // namespace chorus::autograd
