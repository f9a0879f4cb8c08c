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
#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <queue>
#include <set>
#include <thread>
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

// One backward pass: the dependency counts and the pending gradients.
class GraphTask {
 public:
  GraphTask(const Edge& root, const Tensor& seed, bool retain) : retain_(retain) {
    std::vector<Node*> stack{root.fn.get()};
    deps_[root.fn.get()] = 0;
    std::set<Node*> seen{root.fn.get()};
    devices_.insert(root.fn->device);
    while (!stack.empty()) {
      Node* n = stack.back();
      stack.pop_back();
      for (const Edge& e : n->next) {
        if (!e.fn) continue;
        ++deps_[e.fn.get()];
        if (seen.insert(e.fn.get()).second) {
          stack.push_back(e.fn.get());
          devices_.insert(e.fn->device);
        }
      }
    }
    pending_[root.fn.get()].resize(root.fn->num_outputs);
    pending_[root.fn.get()][root.input_nr].push_back({0, seed});
    keep_alive_[root.fn.get()] = root.fn;
    root_ = root.fn.get();
  }

  Node* root() const { return root_; }
  const std::set<Device>& devices() const { return devices_; }

  // Runs node n (outside any lock) and returns the nodes it made ready.
  std::vector<Node*> run(Node* n, std::mutex* mu) {
    TensorList in;
    {
      std::unique_lock<std::mutex> lk = lock(mu);
      in = take_inputs(n);
    }
    TensorList out;
    {
      DeviceGuard guard(n->device);
      out = n->apply(std::move(in));
    }
    if (!retain_) n->release_saved();
    // Move gradients to their destination devices before taking the lock.
    std::vector<Tensor> conformed(n->next.size());
    for (size_t i = 0; i < n->next.size(); ++i)
      if (n->next[i].fn && i < out.size() && out[i].defined()) conformed[i] = conform(out[i], n->input_meta[i]);
    std::vector<Node*> ready;
    std::unique_lock<std::mutex> lk = lock(mu);
    for (size_t i = 0; i < n->next.size(); ++i) {
      const Edge& e = n->next[i];
      if (!e.fn) continue;
      Node* nx = e.fn.get();
      keep_alive_.emplace(nx, e.fn);
      auto& slots = pending_[nx];
      if (slots.empty()) slots.resize(nx->num_outputs);
      if (conformed[i].defined()) slots[e.input_nr].push_back({n->seq, conformed[i]});
      if (--deps_[nx] == 0) ready.push_back(nx);
    }
    keep_alive_.erase(n);
    return ready;
  }

  std::shared_ptr<Node> hold(Node* n) {
    auto it = keep_alive_.find(n);
    return it == keep_alive_.end() ? nullptr : it->second;
  }

 private:
  static std::unique_lock<std::mutex> lock(std::mutex* mu) {
    return mu ? std::unique_lock<std::mutex>(*mu) : std::unique_lock<std::mutex>();
  }

  TensorList take_inputs(Node* n) {
    auto& slots = pending_[n];
    TensorList in(n->num_outputs);
    for (size_t s = 0; s < slots.size() && s < in.size(); ++s) {
      auto& parts = slots[s];
      std::sort(parts.begin(), parts.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
      for (auto& [seq, g] : parts) in[s] = in[s].defined() ? ops::binary(BinaryOp::Add, in[s], g, 1.0) : g;
    }
    pending_.erase(n);
    return in;
  }

  bool retain_;
  Node* root_ = nullptr;
  std::unordered_map<Node*, int> deps_;
  std::unordered_map<Node*, std::vector<std::vector<std::pair<uint64_t, Tensor>>>> pending_;
  std::unordered_map<Node*, std::shared_ptr<Node>> keep_alive_;
  std::set<Device> devices_;
};

void run_single_thread(GraphTask& task) {
  std::priority_queue<Node*, std::vector<Node*>, ByLatest> ready;
  ready.push(task.root());
  while (!ready.empty()) {
    Node* n = ready.top();
    ready.pop();
    std::shared_ptr<Node> keep = task.hold(n);
    for (Node* r : task.run(n, nullptr)) ready.push(r);
  }
}

void run_multi_device(GraphTask& task) {
  std::mutex mu;
  std::condition_variable cv;
  std::map<Device, std::priority_queue<Node*, std::vector<Node*>, ByLatest>> queues;
  int outstanding = 1;  // nodes queued or running
  std::exception_ptr error;
  bool stop = false;
  queues[task.root()->device].push(task.root());

  auto worker = [&](Device dev) {
    NoGradGuard no_grad;
    for (;;) {
      Node* n = nullptr;
      std::shared_ptr<Node> keep;
      {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait(lk, [&] { return stop || !queues[dev].empty(); });
        if (stop) return;
        n = queues[dev].top();
        queues[dev].pop();
        keep = task.hold(n);
      }
      std::vector<Node*> ready;
      try {
        ready = task.run(n, &mu);
      } catch (...) {
        std::lock_guard<std::mutex> lk(mu);
        if (!error) error = std::current_exception();
        stop = true;
        cv.notify_all();
        return;
      }
      std::lock_guard<std::mutex> lk(mu);
      for (Node* r : ready) {
        queues[r->device].push(r);
        ++outstanding;
      }
      if (--outstanding == 0) stop = true;
      cv.notify_all();
    }
  };
  // Every queue exists before any worker starts: workers index the map under
  // `mu`, and inserting here while they run would race on the tree.
  for (const Device& d : task.devices()) queues[d];
  std::vector<std::thread> threads;
  for (const Device& d : task.devices()) threads.emplace_back(worker, d);
  for (auto& t : threads) t.join();
  if (error) std::rethrow_exception(error);
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
  GraphTask task(gradient_edge(root), seed, retain_graph);
  if (task.devices().size() <= 1) {
    run_single_thread(task);
  } else {
    run_multi_device(task);
  }
}

}  // namespace chorus::autograd
