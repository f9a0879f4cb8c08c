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
#include "chorus/autograd/grad_finisher.h"
#include "chorus/autograd/side_work.h"
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
  // A copy to another device or dtype is of the whole value (Note [Gradient
  // sums in the update] in data_parallel/reducer.h).
  if (g.device() == m.device && g.dtype() == m.dtype) return g;
  join_beside_for(g);  // Note [Weight gradients beside the data gradient]
  finish_grad(g);
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
//
// The gradients pending at one input: almost always one, held inline; more
// (a tensor used several times) go to `more`. Two heap allocations per node
// (its state, a vector per slot) were a quarter of a small op's backward.
struct Slot {
  bool has = false;
  uint16_t expected = 0;  // edges into this slot (Note [Gradient addends])
  uint64_t seq = 0;  // the producer's creation number
  Tensor grad;
  std::vector<std::pair<uint64_t, Tensor>> more;

  void add(uint64_t producer, Tensor g) {
    if (!has) {
      has = true;
      seq = producer;
      grad = std::move(g);
    } else {
      more.push_back({producer, std::move(g)});
    }
  }
  // The sum in producer-creation order (latest first), whatever the arrival
  // order. Takes the gradients: the slot lets go of them (their memory is
  // free once the node has run, not at the end of the backward).
  Tensor take_sum() {
    if (!has) return Tensor();
    has = false;
    if (more.empty()) return std::move(grad);
    std::vector<std::pair<uint64_t, Tensor>> parts = std::move(more);
    more.clear();
    parts.push_back({seq, std::move(grad)});
    std::sort(parts.begin(), parts.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    Tensor total;
    for (auto& [producer, g] : parts) {
      join_beside_for(g);  // Note [Weight gradients beside the data gradient]
      finish_grad(g);  // Note [Gradient finishers]: its whole value
      total = total.defined() ? ops::binary(BinaryOp::Add, total, g, 1.0) : g;
    }
    return total;
  }
};

struct NodeState {
  std::shared_ptr<Node> node;  // keeps the node alive until it has run
  std::atomic<int> deps{0};
  std::mutex mu;  // guards slots
  // [input]; up to two inline (most nodes have one output), more on the heap.
  Slot inline_slots[2];
  std::vector<Slot> extra_slots;
  Slot& slot(uint32_t i) { return i < 2 ? inline_slots[i] : extra_slots[i - 2]; }
};

// The gradients offered to the node a thread is running (Note [Gradient
// addends]), indexed by the node's inputs.
struct AddendOffer {
  TensorList grads;
  std::vector<uint64_t> seqs;
  std::vector<bool> taken;
};

thread_local AddendOffer* current_offer = nullptr;

class OfferScope {
 public:
  explicit OfferScope(AddendOffer* o) : prev_(current_offer) { current_offer = o; }
  ~OfferScope() { current_offer = prev_; }
  OfferScope(const OfferScope&) = delete;
  OfferScope& operator=(const OfferScope&) = delete;

 private:
  AddendOffer* prev_;
};

// Whether the pass running Node::apply on this thread keeps the graph
// (backward_keeps_graph in node.h).
thread_local bool current_keeps_graph = false;

class KeepsGraphScope {
 public:
  explicit KeepsGraphScope(bool keeps) : prev_(current_keeps_graph) { current_keeps_graph = keeps; }
  ~KeepsGraphScope() { current_keeps_graph = prev_; }
  KeepsGraphScope(const KeepsGraphScope&) = delete;
  KeepsGraphScope& operator=(const KeepsGraphScope&) = delete;

 private:
  bool prev_;
};

// One backward pass: the dependency counts and the pending gradients.
class GraphTask {
 public:
  // collect_leaves: also gather the reached leaves (Note [Backward observers]).
  // Several roots (Note [Several roots]): each seeded with its own gradient.
  GraphTask(const std::vector<Edge>& roots, const TensorList& seeds, bool retain, bool collect_leaves)
      : retain_(retain), collect_leaves_(collect_leaves) {
    std::vector<Node*> stack;
    for (const Edge& root : roots)
      if (add(root.fn).second) stack.push_back(root.fn.get());
    while (!stack.empty()) {
      Node* n = stack.back();
      stack.pop_back();
      for (const Edge& e : n->next) {
        if (!e.fn) continue;
        auto [st, fresh] = add(e.fn);
        st->deps.fetch_add(1, std::memory_order_relaxed);
        Slot& slot = st->slot(e.input_nr);
        if (slot.expected < UINT16_MAX) ++slot.expected;
        if (fresh) stack.push_back(e.fn.get());
      }
    }
    // A root that another root's graph reaches waits for that gradient too;
    // the others start at once, each on its own device's queue.
    for (size_t i = 0; i < roots.size(); ++i) {
      Node* r = roots[i].fn.get();
      Slot& seeded = states_.at(r).slot(roots[i].input_nr);
      seeded.add(0, seeds[i]);
      // Never offered as an addend (Note [Gradient addends]): a node would
      // accumulate into it in place, and it may be the caller's tensor.
      seeded.expected = UINT16_MAX;
      if (states_.at(r).deps.load(std::memory_order_relaxed) == 0 &&
          std::find(starts_.begin(), starts_.end(), r) == starts_.end())
        starts_.push_back(r);
    }
  }

  const std::vector<Node*>& starts() const { return starts_; }
  const std::set<Device>& devices() const { return devices_; }
  const std::unordered_set<const TensorImpl*>& leaves() const { return leaves_; }

  // Runs node n and returns the nodes it made ready. Safe to call from several
  // threads at once for different nodes.
  // `ready` is cleared first (its capacity reused from node to node).
  void run(Node* n, std::vector<Node*>& ready) {
    ready.clear();
    NodeState& self = states_.at(n);
    std::shared_ptr<Node> keep = std::move(self.node);
    TensorList in = take_inputs(self, n->num_outputs);
    // Note [Weight gradients beside the data gradient]: a node computes with
    // its inputs on the current stream (AccumulateGrad and the reducer's
    // nodes decide for themselves: taking a gradient as .grad reads nothing).
    if (!n->is_accumulate_grad() && !n->orders_beside_reads())
      for (const Tensor& g : in) join_beside_for(g);
    TensorList out;
    AddendOffer offer;
    if (n->takes_addends) offer_addends(n, offer);
    {
      DeviceGuard guard(n->device);
      OfferScope scope(offer.grads.empty() ? nullptr : &offer);
      KeepsGraphScope keeps(retain_);
      out = n->apply(std::move(in));
    }
    return_untaken(n, offer);
    if (!retain_) n->release_saved();
    for (size_t i = 0; i < n->next.size(); ++i) {
      const Edge& e = n->next[i];
      if (!e.fn) continue;
      NodeState& nx = states_.at(e.fn.get());
      if (i < out.size() && out[i].defined()) {
        Tensor g = conform(out[i], n->input_meta[i]);  // to the consumer's device, outside any lock
        std::lock_guard<std::mutex> lk(nx.mu);
        nx.slot(e.input_nr).add(n->seq, std::move(g));
      }
      // acq_rel: whoever takes the count to zero sees every producer's push.
      if (nx.deps.fetch_sub(1, std::memory_order_acq_rel) == 1) ready.push_back(e.fn.get());
    }
  }

 private:
  std::pair<NodeState*, bool> add(const std::shared_ptr<Node>& fn) {
    auto [it, fresh] = states_.try_emplace(fn.get());  // the state built in place, never moved
    if (fresh) {
      it->second.node = fn;
      if (fn->num_outputs > 2) it->second.extra_slots.resize(fn->num_outputs - 2);
      devices_.insert(fn->device);
      if (collect_leaves_)
        if (const TensorImpl* leaf = fn->accumulated_leaf()) leaves_.insert(leaf);
    }
    return {&it->second, fresh};
  }

  // Note [Gradient addends]: moves out, for each input of n whose slot
  // expects two gradients and holds one, that gradient.
  void offer_addends(Node* n, AddendOffer& offer) {
    for (size_t i = 0; i < n->next.size(); ++i) {
      const Edge& e = n->next[i];
      if (!e.fn) continue;
      NodeState& nx = states_.at(e.fn.get());
      std::lock_guard<std::mutex> lk(nx.mu);
      Slot& slot = nx.slot(e.input_nr);
      if (slot.expected != 2 || !slot.has || !slot.more.empty()) continue;
      // A gradient with a pending part is not accumulated into in place.
      if (slot.grad.defined() && pending_part(slot.grad).defined()) continue;
      if (offer.grads.empty()) {
        offer.grads.resize(n->next.size());
        offer.seqs.resize(n->next.size());
        offer.taken.assign(n->next.size(), false);
      }
      join_beside_before_write(slot.grad);  // the node adds into it on the current stream
      offer.seqs[i] = slot.seq;
      offer.grads[i] = std::move(slot.grad);
      slot.grad = Tensor();
      slot.has = false;
    }
  }

  // Puts the addends apply() did not take back where they were.
  void return_untaken(Node* n, AddendOffer& offer) {
    for (size_t i = 0; i < offer.grads.size(); ++i) {
      if (!offer.grads[i].defined() || offer.taken[i]) continue;
      const Edge& e = n->next[i];
      NodeState& nx = states_.at(e.fn.get());
      std::lock_guard<std::mutex> lk(nx.mu);
      nx.slot(e.input_nr).add(offer.seqs[i], std::move(offer.grads[i]));
    }
  }

  // Gradients arriving at one slot are summed in producer-creation order.
  static TensorList take_inputs(NodeState& st, size_t n) {
    TensorList in(n);
    std::lock_guard<std::mutex> lk(st.mu);  // every producer has pushed; this orders the reads
    for (size_t s = 0; s < n; ++s) in[s] = st.slot(static_cast<uint32_t>(s)).take_sum();
    return in;
  }

  bool retain_;
  bool collect_leaves_;
  std::unordered_set<const TensorImpl*> leaves_;
  std::vector<Node*> starts_;  // the roots no other root reaches
  std::unordered_map<Node*, NodeState> states_;
  std::set<Device> devices_;
};

void run_single_thread(GraphTask& task) {
  std::priority_queue<Node*, std::vector<Node*>, ByLatest> ready;
  std::vector<Node*> made_ready;
  for (Node* n : task.starts()) ready.push(n);
  while (!ready.empty()) {
    Node* n = ready.top();
    ready.pop();
    task.run(n, made_ready);
    for (Node* r : made_ready) ready.push(r);
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
  std::atomic<int> outstanding{static_cast<int>(task.starts().size())};  // nodes queued or running
  std::atomic<bool> stop{false};
  std::mutex error_mu;
  std::exception_ptr error;
  for (Node* n : task.starts()) queues.at(n->device)->nodes.push(n);

  auto stop_all = [&] {
    stop.store(true);
    for (auto& [d, q] : queues) {
      std::lock_guard<std::mutex> lk(q->mu);  // a waiter between its check and its sleep still wakes
      q->cv.notify_all();
    }
  };
  auto worker = [&](Device dev) {
    NoGradGuard no_grad;
    BesideScope beside(dev);  // Note [Weight gradients beside the data gradient]
    ReadyQueue& mine = *queues.at(dev);
    std::vector<Node*> ready;  // the nodes each run makes ready
    for (;;) {
      Node* n = nullptr;
      {
        std::unique_lock<std::mutex> lk(mine.mu);
        mine.cv.wait(lk, [&] { return stop.load() || !mine.nodes.empty(); });
        if (stop.load()) return;
        n = mine.nodes.top();
        mine.nodes.pop();
      }
      try {
        task.run(n, ready);
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

bool backward_keeps_graph() { return current_keeps_graph; }

Tensor take_gradient_addend(size_t input) {
  AddendOffer* o = current_offer;
  if (!o || input >= o->grads.size() || !o->grads[input].defined() || o->taken[input]) return Tensor();
  o->taken[input] = true;
  return std::move(o->grads[input]);
}

void run_backward(const Tensor& root, const Tensor& grad, bool retain_graph) {
  run_backward(TensorList{root}, grad.defined() ? TensorList{grad} : TensorList{}, retain_graph);
}

void run_backward(const TensorList& roots, const TensorList& grads, bool retain_graph) {
  CHORUS_CHECK(!roots.empty(), "backward: no tensors given");
  CHORUS_CHECK(grads.empty() || grads.size() == roots.size(), "backward: ", roots.size(), " tensors but ", grads.size(),
               " gradients; pass one gradient per tensor, or none for tensors of one element");
  std::vector<Edge> edges;
  TensorList seeds;
  for (size_t i = 0; i < roots.size(); ++i) {
    const Tensor& root = roots[i];
    const std::string which = roots.size() == 1 ? std::string("self") : "tensors[" + std::to_string(i) + "]";
    chorus::detail::check_defined(root, "backward", which.c_str());
    CHORUS_CHECK(root.requires_grad(), "backward: ", roots.size() == 1 ? "the tensor" : which,
                 " does not require grad and has no grad_fn (did you run the "
                 "forward pass under NoGradGuard, or forget requires_grad on the parameters?)");
    Tensor seed = grads.empty() ? Tensor() : grads[i];
    if (!seed.defined()) {
      CHORUS_CHECK(root.numel() == 1, "backward: the gradient can be implied only for a tensor with one element, got ",
                   root.describe(), "; pass a gradient of the same shape");
      seed = ones(root.sizes(), {root.dtype(), root.device()});
    } else {
      CHORUS_CHECK(seed.sizes() == root.sizes(), "backward: gradient ", seed.describe(),
                   " does not match the tensor ", root.describe());
    }
    edges.push_back(gradient_edge(root));
    seeds.push_back(std::move(seed));
  }
  NoGradGuard no_grad;  // backward formulas are not themselves recorded
  const std::vector<std::shared_ptr<BackwardObserver>> observers = detail::live_backward_observers();
  GraphTask task(edges, seeds, retain_graph, !observers.empty());
  for (const auto& o : observers) o->begin(task.leaves());
  try {
    if (task.devices().size() <= 1) {
      BesideScope beside;  // joins every side stream when the pass ends, or throws
      run_single_thread(task);
    } else {
      run_multi_device(task);
      join_all_beside();  // what a failed worker left (each joins its own device)
    }
  } catch (...) {
    for (const auto& o : observers) o->end(false);
    throw;
  }
  for (const auto& o : observers) o->end(true);
}

}  // namespace chorus::autograd
