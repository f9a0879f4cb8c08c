// ProcessGroup: collectives over the processes of a job (PyTorch's c10d
// ProcessGroup): Gloo for CPU tensors, NCCL for CUDA tensors. Every call
// returns a Work handle at once; Work::wait() blocks until the operation is
// done (CPU) or ordered before the caller's later work (CUDA) and rethrows its
// failure.
//
// Note [Collective timeouts]: every operation has a deadline
// (options.timeout, 300 s by default; `--dist-timeout`). When one does not
// finish in time — a rank died, stopped, or took another code path — the
// group is aborted (Gloo: the operation's own timeout and closing every pair;
// NCCL: ncclCommAbort) and DistError names the operation, its sequence number
// in this group and the ranks that did not arrive. Those are found by a roll
// call through the store after the failure: each surviving rank writes its
// name under the failed sequence number and waits a short grace period
// (min(timeout, 5 s)); the ranks that never write are the ones named. No store
// traffic happens on the normal path, so the cost is paid only on failure.
// After a failure the group is unusable: every later call throws at once.
//
// Note [Ranks named in the job's numbering]: a subgroup numbers its members
// from 0 (a device mesh's tp group of job ranks 2 and 3 has ranks 0 and 1),
// but a message that names a rank is read beside the launcher's, which
// numbers the job. So a subgroup keeps its members' job ranks
// (ProcessGroupOptions::job_ranks, set by new_group) and its failures and
// warnings name those. Its roll calls keep the group's own numbering (the
// keys are the group's).
//
// Note [Failures that cascade]: in a job of several groups a dead rank is
// waited for by its own groups' members only; the others wait for those
// members, which leave when their collective fails, and a roll call would
// name a rank that is alive and has told what it saw. So each rank that
// fails records in the job's store that it is failing ("chorus/failing/<job
// rank>", as its roll call begins) and then the ranks it found missing
// ("chorus/gave-up/<job rank>"); a roll call that finds a rank missing which
// left so names the ranks that one found instead (the dead rank, whichever
// group the failure reached this rank through), and says which ranks left
// before it. A missing rank that is failing but has not said yet (ranks that
// timed out together, around a stopped rank) is waited for, at most a roll
// call's grace; one that never began failing (dead, stopped) costs no wait.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "chorus/core/tensor.h"
#include "chorus/distributed/store.h"

namespace chorus::dist {

enum class ReduceOp { Sum, Avg, Max, Min };
const char* reduce_op_name(ReduceOp op);

class Work {
 public:
  virtual ~Work() = default;
  virtual bool is_completed() = 0;
  // Blocks until done; rethrows the operation's DistError.
  virtual void wait() = 0;
};
using WorkPtr = std::shared_ptr<Work>;

struct ProcessGroupOptions {
  std::chrono::milliseconds timeout = std::chrono::seconds(300);
  // The address other ranks reach this one at (Gloo); empty: 127.0.0.1, or
  // the interface GLOO_SOCKET_IFNAME names. init_process_group sets it to the
  // local address of the route to the master.
  std::string local_addr;
  // Names this group's keys in the store (subgroups get their own).
  std::string name = "default";
  // Set by new_group (Note [Ranks named in the job's numbering]): the job's
  // rank of each member, and the store of the group the job began with.
  // Empty/null: this group is the job's own (member i is rank i).
  std::vector<int> job_ranks;
  StorePtr job_store;
};

class ProcessGroup {
 public:
  ProcessGroup(int rank, int size, StorePtr store, ProcessGroupOptions options)
      : rank_(rank), size_(size), store_(std::move(store)), options_(options) {}
  virtual ~ProcessGroup() = default;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // Member `r`'s rank in the job (the group new_group's were made from, all
  // the way up): what a message names (Note [Ranks named in the job's numbering]).
  int job_rank(int r) const { return options_.job_ranks.empty() ? r : options_.job_ranks.at(static_cast<size_t>(r)); }
  // The store every group of the job shares (this group's own for the job's group).
  const StorePtr& job_store() const { return options_.job_store ? options_.job_store : store_; }
  virtual std::string backend() const = 0;
  // The device its tensors live on: cpu:0 for Gloo (any CPU device's tensors
  // are taken), the group's GPU for NCCL (only that GPU's).
  virtual Device device() const = 0;
  const ProcessGroupOptions& options() const { return options_; }
  const StorePtr& store() const { return store_; }

  // In place, on every rank: t = op over the ranks' t. float32, bfloat16,
  // float64, int64 (Avg: floating types only).
  virtual WorkPtr all_reduce(const Tensor& t, ReduceOp op = ReduceOp::Sum) = 0;
  // t = root's t, on every rank.
  virtual WorkPtr broadcast(const Tensor& t, int root) = 0;
  // out = the ranks' `in`, concatenated in rank order (out.numel() == size() * in.numel()).
  virtual WorkPtr all_gather(const Tensor& in, const Tensor& out) = 0;
  // out = rank r's chunk (r = rank()) of op over the ranks' `in`
  // (in.numel() == size() * out.numel()). `out` may be in's own chunk,
  // in.narrow(0, rank() * out.numel(), out.numel()): in place (NCCL's
  // in-place form; Gloo reduces a copy of `in`), as ShardedDataParallel's
  // stage 1 does (Note [Sharded gradient shards]).
  virtual WorkPtr reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op = ReduceOp::Sum) = 0;
  virtual WorkPtr barrier() = 0;
  // Point to point; a send and its recv name the same tag.
  virtual WorkPtr send(const Tensor& t, int dst, int tag = 0) = 0;
  virtual WorkPtr recv(const Tensor& t, int src, int tag = 0) = 0;

  // A subgroup of `ranks` (ranks of this group, distinct, any order: the
  // subgroup's rank i is ranks[i]), on the same backend, with its own store
  // namespace and communicator. Every rank of this group must call new_group
  // with the same lists in the same order (as in PyTorch); ranks outside
  // `ranks` get nullptr. `label` names it (with a number: "<name>/tp2"),
  // and its track in a step trace ("gloo tp", trace_track()).
  std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks, const std::string& label = "sub");

  // The track its collectives take in a step trace (Note [Step traces]):
  // the backend's name ("gloo") for a group of its own, with the label of a
  // subgroup ("gloo tp"), so that the groups of a device mesh, whose
  // collectives run at once, each have a track.
  std::string trace_track() const;

 protected:
  // Checks shared by the backends (defined tensors, dtypes, contiguity, sizes).
  void check_tensor(const char* op, const Tensor& t) const;
  void check_peer(const char* op, int peer, const char* what) const;
  int rank_, size_;
  StorePtr store_;
  ProcessGroupOptions options_;
  int subgroups_ = 0;  // new_group calls so far: names the next subgroup
};
using ProcessGroupPtr = std::shared_ptr<ProcessGroup>;

// Which backends this build has ("gloo", "nccl").
bool gloo_available();
bool nccl_backend_available();

// A group of `size` ranks meeting through `store` (every rank passes the same
// store contents and a distinct rank). backend: "gloo" or "nccl". Throws
// DistError naming a backend this build lacks.
ProcessGroupPtr make_process_group(const std::string& backend, int rank, int size, StorePtr store,
                                   ProcessGroupOptions options = {});

}  // namespace chorus::dist
