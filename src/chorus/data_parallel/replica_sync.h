// What every data-parallel wrapper over a process group does to its replica
// at construction and before a forward (DistributedDataParallel,
// ShardedDataParallel): check that the ranks hold the same model (Note [DDP
// model check] in data_parallel/ddp.h), copy rank 0's values everywhere, and keep
// buffers in one flat tensor per device and dtype so that a broadcast is one
// collective each.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

#include "chorus/data_parallel/flat_layout.h"
#include "chorus/distributed/process_group.h"
#include "chorus/nn/module.h"
#include "chorus/ops/copy.h"

namespace chorus::dist {

// A collective on `t`, wherever it lives: through a copy on the group's
// device when the group cannot take it directly (an NCCL group takes its own
// GPU's tensors only).
template <typename Issue>
void on_group_device(ProcessGroup& group, const Tensor& t, Issue issue) {
  const Device home = group.device();
  const bool hop = home.is_cuda() && t.device() != home;
  Tensor wire = hop ? ops::to_device(t, home) : t;
  issue(wire)->wait();
  if (hop) ops::copy_(t, wire);
}

// Tensors grouped into one flat buffer per device and dtype.
struct FlatSet {
  struct PerDevice {
    FlatLayout layout;
    std::vector<Tensor> flats;  // [group]
    std::vector<size_t> members;  // indices into the tensor list
  };
  std::vector<PerDevice> devices;

  explicit FlatSet(const std::vector<Tensor>& ts);
  // Tensor i's view (the tensor list's order).
  std::vector<Tensor> views(size_t n) const;
  // rank 0's flat buffers to every rank.
  void broadcast(ProcessGroup& group) const;
};

// Note [DDP buffers]: the module's buffers re-pointed, once, at views of one
// flat buffer per device and dtype (their values copied in), so that
// broadcasting rank 0's is one collective each. nullptr when it has none.
std::unique_ptr<FlatSet> flatten_module_buffers(nn::Module& module);
// Rank 0's buffers (flattened above) to every rank, their versions bumped so
// that DataParallel replicas inside a rank re-sync.
void broadcast_module_buffers(const FlatSet& buffers, ProcessGroup& group, nn::Module& module);

// A wrapper's no_sync(): while the guard lives `flag` is set (under `mu`),
// and its previous value is put back after. `state` keeps them alive.
class NoSyncGuard {
 public:
  NoSyncGuard(std::shared_ptr<void> state, std::mutex& mu, bool& flag);
  ~NoSyncGuard();
  NoSyncGuard(NoSyncGuard&& other) noexcept;
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(NoSyncGuard&&) = delete;

 private:
  std::shared_ptr<void> state_;
  std::mutex* mu_;
  bool* flag_;
  bool prev_;
};

// rank 0's values into `ts` (packed, one broadcast per device and dtype).
void broadcast_in_place(ProcessGroup& group, const std::vector<Tensor>& ts);

// "parameter 'fc.weight' [4, 3] float32": a line of the model's signature.
std::string describe(const std::string& kind, const std::string& name, const Tensor& t);

// A wrapper's parameters, checked: every trainable one on a device `group`
// reduces (ValueError from `who` naming it: on the group's own GPU when
// `group_device_only`, else on any GPU for NCCL, on CPUs for Gloo), at least
// one of them, and the same model on every rank (check_same_model below;
// `key` names the check in the store). A collective.
// Note [Nested backward passes]: a backward pass may run others inside it --
// a recomputed block (nn::checkpoint, --recompute) runs a small backward of
// its own from inside the outer pass's node -- and the engine calls every
// observer's begin() and end() for each (Note [Backward observers]). Only the
// outermost pass that reaches the wrapper's parameters is the step's: the
// inner pass's end() must not finish it (reduce every bucket, with the
// recomputed blocks' gradients still to come). PassStack pairs each end()
// with its begin() (passes nest: an inner one ends before its outer one).
class PassStack {
 public:
  // begin(): whether this pass reaches the wrapper's parameters.
  void push(bool ours) { passes_.push_back(ours ? 1 : 0); }
  // begin() of a pass whose leaves are `leaves`: pushed as ours when it
  // reaches any of `params` (the wrapper's); returns whether it does.
  bool push(const std::unordered_set<const TensorImpl*>& leaves, const std::vector<Tensor>& params);
  // end(): whether the ending pass was ours, and its depth (1: outermost).
  struct Ended {
    bool ours = false;
    size_t depth = 0;
  };
  Ended pop() {
    if (passes_.empty()) return {};
    Ended e{passes_.back() != 0, passes_.size()};
    passes_.pop_back();
    return e;
  }
  size_t depth() const { return passes_.size(); }
  // Whether a pass of ours is still running (the ending one excluded).
  bool any_ours() const {
    for (char p : passes_)
      if (p) return true;
    return false;
  }

 private:
  std::vector<char> passes_;
};

// The armed pass's begin(): the indices of the `params` that `leaves` (the
// pass's leaves) do not reach, and `used` [k] (resized) set to whether
// params[k] takes part in this step: reached, or holding a gradient already
// (accumulated over no_sync steps before it).
std::vector<size_t> unreached_params(const std::unordered_set<const TensorImpl*>& leaves,
                                     const std::vector<Tensor>& params, std::vector<int64_t>& used);

struct ReplicaParameters {
  std::vector<std::string> names;  // of `trainable`, the module's order
  std::vector<Tensor> trainable, frozen;
};
ReplicaParameters check_replica(const nn::Module& module, ProcessGroup& group, const std::string& who,
                                const std::string& key, bool group_device_only);

// Note [DDP model check] (data_parallel/ddp.h): ValueError from `who` naming the first
// rank and line of `mine` that differ from rank 0's; `key` names this check's
// keys in the store. A collective.
void check_same_model(ProcessGroup& group, const std::vector<std::string>& mine, const std::string& who,
                      const std::string& key);

}  // namespace chorus::dist
