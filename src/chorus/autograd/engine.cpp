#include "chorus/autograd/engine.h"

#include <queue>
#include <unordered_map>

#include "chorus/autograd/grad_mode.h"
#include "chorus/autograd/node.h"
#include "chorus/core/error.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/elementwise.h"
#include "chorus/ops/factory.h"

namespace chorus::autograd {

namespace {

struct ByLatest {
  bool operator()(const Node* a, const Node* b) const { return a->seq < b->seq; }
};

Tensor conform(const Tensor& g, const InputMeta& m) {
  return ops::to_dtype(ops::to_device(g, m.device), m.dtype);
}

}  // namespace

void run_backward(const Tensor& root, const Tensor& grad, bool retain_graph) {
  detail::check_defined(root, "backward", "self");
  CHORUS_CHECK(root.requires_grad(),
               "backward: the tensor does not require grad and has no grad_fn (did you run the "
               "forward pass under NoGradGuard, or forget requires_grad on the parameters?)");
  Tensor seed = grad;
  if (!seed.defined()) {
    CHORUS_CHECK(root.numel() == 1, "backward: the gradient can be implied only for a tensor with one element, got ",
                 root.describe(), "; pass a gradient of the same shape");
    seed = ones(root.sizes(), {root.dtype(), root.device()});
  } else {
    CHORUS_CHECK(seed.sizes() == root.sizes(), "backward: gradient ", seed.describe(),
                 " does not match the tensor ", root.describe());
  }
  NoGradGuard no_grad;  // backward formulas are not themselves recorded
  Edge root_edge = gradient_edge(root);

  // Count, for each node, how many edges point into it.
  std::unordered_map<Node*, int> deps;
  std::vector<Node*> stack{root_edge.fn.get()};
  deps[root_edge.fn.get()] = 0;
  std::unordered_map<Node*, bool> seen{{root_edge.fn.get(), true}};
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const Edge& e : n->next) {
      if (!e.fn) continue;
      ++deps[e.fn.get()];
      if (!seen[e.fn.get()]) {
        seen[e.fn.get()] = true;
        stack.push_back(e.fn.get());
      }
    }
  }

  // Gradient buffers: one slot per output of each node, summed as they arrive.
  std::unordered_map<Node*, TensorList> buffers;
  std::unordered_map<Node*, std::shared_ptr<Node>> keep_alive;
  buffers[root_edge.fn.get()].resize(root_edge.fn->num_outputs);
  buffers[root_edge.fn.get()][root_edge.input_nr] = seed;
  keep_alive[root_edge.fn.get()] = root_edge.fn;

  std::priority_queue<Node*, std::vector<Node*>, ByLatest> ready;
  ready.push(root_edge.fn.get());
  while (!ready.empty()) {
    Node* n = ready.top();
    ready.pop();
    TensorList in_grads = std::move(buffers[n]);
    buffers.erase(n);
    TensorList out_grads;
    {
      DeviceGuard guard(n->device);
      out_grads = n->apply(std::move(in_grads));
    }
    if (!retain_graph) n->release_saved();
    for (size_t i = 0; i < n->next.size(); ++i) {
      const Edge& e = n->next[i];
      if (!e.fn) continue;
      Node* nx = e.fn.get();
      keep_alive.emplace(nx, e.fn);
      if (i < out_grads.size() && out_grads[i].defined()) {
        Tensor g = conform(out_grads[i], n->input_meta[i]);
        TensorList& buf = buffers[nx];
        if (buf.empty()) buf.resize(nx->num_outputs);
        if (!buf[e.input_nr].defined()) {
          buf[e.input_nr] = g;
        } else {
          buf[e.input_nr] = ops::binary(BinaryOp::Add, buf[e.input_nr], g, 1.0);
        }
      }
      if (--deps[nx] == 0) {
        if (buffers[nx].empty()) buffers[nx].resize(nx->num_outputs);
        ready.push(nx);
      }
    }
    keep_alive.erase(n);
  }
}

}  // namespace chorus::autograd
