// The backward engine.
//
// Note [Backward on many devices]: every node runs on the device of its
// forward op. When the graph touches one device, the calling thread runs it
// (no thread hops; GPU work is only enqueued anyway). When it spans several
// (DataParallel replicas, model parallelism), each device gets its own worker
// thread, so CPU devices compute concurrently and each GPU's host-side work is
// issued from its own thread, as PyTorch's engine does.
//
// Gradients arriving at one input slot are summed in the order of the
// producing nodes' creation, not of arrival, so results do not depend on how
// the device threads interleave.
#include "chorus/autograd/engine.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <queue>
#include <set>
#include <functional>
#include <unordered_map>

#include "chorus/autograd/backward_observer.h"
#include "chorus/autograd/grad_mode.h"
#include "chorus/autograd/node.h"
#include "chorus/core/device_threads.h"
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

// Note [Engine locking]: the graph is walked once up front, so the per-node
// state below is fixed before any node runs and the map to it is only read
// afterwards. Each node's pending gradients have their own mutex and its
// dependency count is an atomic, so device threads working on different parts
// of the graph (DataParallel's replicas) never wait for one another; they
// meet only where edges cross devices. One graph-wide lock, taken twice per
// node and woken for every node on every thread, made four replica threads
// issue slower than one.
struct NodeState {
  std::shared_ptr<Node> node;  // keeps the node alive until it has run
  std::atomic<int> deps{0};
  std::mutex mu;                                                    // guards slots
  std::vector<std::vector<std::pair<uint64_t, Tensor>>> slots;     // [input] (producer seq, gradient)
};

// One backward pass: the dependency counts and the pending gradients.
class GraphTask {
 public:
  // collect_leaves: also gather the reached leaves (Note [Backward observers]).
  GraphTask(const Edge& root, const Tensor& seed, bool retain, bool collect_leaves)
      : retain_(retain), collect_leaves_(collect_leaves) {
    root_ = root.fn.get();
    add(root.fn);
    std::vector<Node*> stack{root_};
    while (!stack.empty()) {
      Node* n = stack.back();
      stack.pop_back();
      for (const Edge& e : n->next) {
        if (!e.fn) continue;
        auto [st, fresh] = add(e.fn);
        st->deps.fetch_add(1, std::memory_order_relaxed);
        if (fresh) stack.push_back(e.fn.get());
      }
    }
    states_.at(root_)->slots[root.input_nr].push_back({0, seed});
  }

  Node* root() const { return root_; }
  const std::set<Device>& devices() const { return devices_; }
  const std::unordered_set<const TensorImpl*>& leaves() const { return leaves_; }

  // Runs node n and returns the nodes it made ready. Safe to call from several
  // threads at once for different nodes.
  std::vector<Node*> run(Node* n) {
    NodeState& self = *states_.at(n);
    std::shared_ptr<Node> keep = std::move(self.node);
    TensorList in = take_inputs(self, n->num_outputs);
    TensorList out;
    {
      DeviceGuard guard(n->device);
      out = n->apply(std::move(in));
    }
    if (!retain_) n->release_saved();
    std::vector<Node*> ready;
    for (size_t i = 0; i < n->next.size(); ++i) {
      const Edge& e = n->next[i];
      if (!e.fn) continue;
      NodeState& nx = *states_.at(e.fn.get());
      if (i < out.size() && out[i].defined()) {
        Tensor g = conform(out[i], n->input_meta[i]);  // to the consumer's device, outside any lock
        std::lock_guard<std::mutex> lk(nx.mu);
        nx.slots[e.input_nr].push_back({n->seq, std::move(g)});
      }
      // acq_rel: whoever takes the count to zero sees every producer's push.
      if (nx.deps.fetch_sub(1, std::memory_order_acq_rel) == 1) ready.push_back(e.fn.get());
    }
    return ready;
  }

 private:
  std::pair<NodeState*, bool> add(const std::shared_ptr<Node>& fn) {
    auto [it, fresh] = states_.try_emplace(fn.get());
    if (fresh) {
      it->second = std::make_unique<NodeState>();
      it->second->node = fn;
      it->second->slots.resize(fn->num_outputs);
      devices_.insert(fn->device);
      if (collect_leaves_)
        if (const TensorImpl* leaf = fn->accumulated_leaf()) leaves_.insert(leaf);
    }
    return {it->second.get(), fresh};
  }

  // Gradients arriving at one slot are summed in producer-creation order.
  static TensorList take_inputs(NodeState& st, size_t n) {
    std::vector<std::vector<std::pair<uint64_t, Tensor>>> slots;
    {
      std::lock_guard<std::mutex> lk(st.mu);
      slots = std::move(st.slots);
    }
    TensorList in(n);
    for (size_t s = 0; s < slots.size() && s < in.size(); ++s) {
      auto& parts = slots[s];
      std::sort(parts.begin(), parts.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
      for (auto& [seq, g] : parts) in[s] = in[s].defined() ? ops::binary(BinaryOp::Add, in[s], g, 1.0) : g;
    }
    return in;
  }

  bool retain_;
  bool collect_leaves_;
  std::unordered_set<const TensorImpl*> leaves_;
  Node* root_ = nullptr;
  std::unordered_map<Node*, std::unique_ptr<NodeState>> states_;
  std::set<Device> devices_;
};

void run_single_thread(GraphTask& task) {
  std::priority_queue<Node*, std::vector<Node*>, ByLatest> ready;
  ready.push(task.root());
  while (!ready.empty()) {
    Node* n = ready.top();
    ready.pop();
    for (Node* r : task.run(n)) ready.push(r);
  }
}

// A device thread's ready nodes. Only its own thread pops; any thread pushes.
struct ReadyQueue {
  std::mutex mu;
  std::condition_variable cv;
  std::priority_queue<Node*, std::vector<Node*>, ByLatest> nodes;
};

void run_multi_device(GraphTask& task) {
  std::map<Device, std::unique_ptr<ReadyQueue>> queues;  // fixed before the workers start
  for (const Device& d : task.devices()) queues[d] = std::make_unique<ReadyQueue>();
  std::atomic<int> outstanding{1};  // nodes queued or running
  std::atomic<bool> stop{false};
  std::mutex error_mu;
  std::exception_ptr error;
  queues.at(task.root()->device)->nodes.push(task.root());

  auto stop_all = [&] {
    stop.store(true);
    for (auto& [d, q] : queues) {
      std::lock_guard<std::mutex> lk(q->mu);  // a waiter between its check and its sleep still wakes
      q->cv.notify_all();
    }
  };
  auto worker = [&](Device dev) {
    NoGradGuard no_grad;
    ReadyQueue& mine = *queues.at(dev);
    for (;;) {
      Node* n = nullptr;
      {
        std::unique_lock<std::mutex> lk(mine.mu);
        mine.cv.wait(lk, [&] { return stop.load() || !mine.nodes.empty(); });
        if (stop.load()) return;
        n = mine.nodes.top();
        mine.nodes.pop();
      }
      std::vector<Node*> ready;
      try {
        ready = task.run(n);
      } catch (...) {
        {
          std::lock_guard<std::mutex> lk(error_mu);
          if (!error) error = std::current_exception();
        }
        stop_all();
        return;
      }
      outstanding.fetch_add(static_cast<int>(ready.size()));
      for (Node* r : ready) {
        ReadyQueue& q = *queues.at(r->device);
        {
          std::lock_guard<std::mutex> lk(q.mu);
          q.nodes.push(r);
        }
        if (&q != &mine) q.cv.notify_one();
      }
      if (outstanding.fetch_sub(1) == 1) stop_all();
    }
  };
  // The device threads come from the shared pool (Note [Device thread pool]
  // in core/device_threads.h): no thread is created per backward.
  std::vector<Device> devices(task.devices().begin(), task.devices().end());
  std::vector<std::function<void()>> loops;
  for (const Device& d : devices) loops.push_back([&worker, d] { worker(d); });
  for (std::exception_ptr& e : DeviceThreadPool::global().run(devices, loops))
    if (e && !error) error = e;  // the worker loops catch node errors; this is anything else
  if (error) std::rethrow_exception(error);
}

}  // namespace

void run_backward(const Tensor& root, const Tensor& grad, bool retain_graph) {
  chorus::detail::check_defined(root, "backward", "self");
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
  const std::vector<std::shared_ptr<BackwardObserver>> observers = detail::live_backward_observers();
  GraphTask task(gradient_edge(root), seed, retain_graph, !observers.empty());
  for (const auto& o : observers) o->begin(task.leaves());
  try {
    if (task.devices().size() <= 1) {
      run_single_thread(task);
    } else {
      run_multi_device(task);
    }
  } catch (...) {
    for (const auto& o : observers) o->end(false);
    throw;
  }
  for (const auto& o : observers) o->end(true);
}

}  // namespace chorus::autograd
