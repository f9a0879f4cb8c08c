// DistributedDataParallel: one model replica per process, gradients
// all-reduced over a process group while the backward still runs (PyTorch's
// torch.nn.parallel.DistributedDataParallel).
//
//   auto pg = dist::init_process_group();               // under chorus launch / torchrun / mpirun / srun
//   auto ddp = std::make_shared<dist::DistributedDataParallel>(model, pg);
//   optim::SGD opt(model->parameters(), ...);           // the optimizer sees the plain model
//   Tensor loss = cross_entropy(ddp->forward(x), y);    // x: this rank's share of the batch
//   opt.zero_grad(); loss.backward(); opt.step();       // gradients averaged over the ranks
//
//   { auto guard = ddp->no_sync(); ... loss.backward(); }  // accumulate without communicating
//
// The wrapped module may span several devices: a model-parallel module (its
// parameters' buckets are per device), or a parallel::DataParallel over the
// GPUs of this process (sum inside the process, then across processes).
// Options first; the Notes after the class say how it works.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "chorus/data_parallel/comm_hooks.h"
#include "chorus/distributed/process_group.h"
#include "chorus/data_parallel/reducer.h"
#include "chorus/data_parallel/replica_sync.h"
#include "chorus/nn/module.h"

namespace chorus::dist {

struct DDPOptions {
  // Note [Gradient buckets] (data_parallel/grad_buckets.h). Negative: ValueError.
  int64_t bucket_bytes = int64_t{25} << 20;
  int64_t first_bucket_bytes = int64_t{1} << 20;  // closes the first bucket early: communication starts sooner
  int64_t last_bucket_bytes = int64_t{1} << 20;   // the first layers' own bucket: a short tail after the backward
  bool average = true;                             // false: gradients summed over the ranks
  bool broadcast_buffers = true;                   // rank 0's buffers to every rank before each forward
  CommHookKind comm_hook = CommHookKind::AllReduce;  // Bf16Compress: float32 buckets travel as bfloat16
  // A hook of the user's own (data_parallel/comm_hook.h: one buffer per bucket and
  // dtype, srcs of one element); when set, it replaces comm_hook.
  std::shared_ptr<CommHook> hook;
  // After the first backward, re-plan the buckets in the order gradients
  // became ready (rank 0's order, so every rank plans the same buckets).
  bool rebuild_buckets = true;
};

class DistributedDataParallel : public nn::Module {
 public:
  // Broadcasts rank 0's parameters and buffers after checking that every rank
  // holds the same model (ValueError naming the first rank and tensor that
  // differ). A collective: every rank of `group` constructs it, in the same
  // order as its other DDP modules and collectives.
  DistributedDataParallel(nn::ModulePtr module, ProcessGroupPtr group, DDPOptions options = {});
  ~DistributedDataParallel() override;

  Tensor forward(const Tensor& x) override;
  nn::Value forward_value(const nn::Value& x) override;

  // While the guard lives, forwards arm no reduction: backwards accumulate
  // into .grad locally, and the first backward after it reduces the sum.
  using NoSync = NoSyncGuard;
  [[nodiscard]] NoSync no_sync();

  // Rank 0's buffers to every rank now (a collective), e.g. before an
  // evaluation whose batch-norm statistics should be the same everywhere.
  void broadcast_buffers();

  const nn::ModulePtr& module() const { return module_; }
  const ProcessGroupPtr& process_group() const;
  const DDPOptions& options() const;
  // The current bucket plan over the parameters (in parameters() order).
  const GradBuckets& buckets() const;
  // Parameters that took no part in the last reduced step on any rank (their
  // .grad was left as it was); empty when every parameter was used somewhere.
  std::vector<std::string> unused_parameters() const;
  // Host seconds this process has spent, over all backwards so far, waiting
  // for the last buckets' all-reduces after its own backward was done: time
  // spent waiting for slower ranks (chorus train's --stats-every line).
  double gradient_wait_seconds() const;

 protected:
  std::shared_ptr<nn::Module> make_empty() const override;

 private:
  struct Impl;
  nn::ModulePtr module_;
  std::shared_ptr<Impl> impl_;
  std::shared_ptr<void> observer_handle_;
};

// Note [DDP model check]: at construction each rank hashes the names, shapes
// and dtypes of its parameters and buffers; one all_gather of the hashes
// compares them. Only on a mismatch does each rank put its full description
// in the store, so the error (the same on every rank) can name the first
// rank that differs from rank 0 and the first tensor where it differs.
//
// Note [DDP unused parameters]: a parameter the forward did not use gets no
// gradient, and PyTorch's reducer then waits for it forever unless the user
// passes find_unused_parameters=True, which walks the autograd graph from the
// outputs after every forward. Here the engine reports the leaves a backward
// will reach from the walk it makes anyway to count dependencies (Note
// [Backward observers]), so the unused parameters are known, and marked
// ready, before the first gradient arrives; a parameter reached but given no
// gradient is flushed when the backward ends. Whether a parameter was used on
// *some* rank decides whether it gets the reduced gradient or keeps no .grad
// (as one process on the global batch would): each armed backward all-reduces
// a used-flag per parameter (one int64 each), issued right after the last
// bucket (so it adds no meeting point of the ranks in mid-step). The result
// is read on the host only by a rank that left some parameter unused in that
// step. Cost in the common case: one small all-reduce per step behind the
// last bucket (the device's later work waits for it, as it waits for the last
// bucket: a step owes nothing to the next, so it can be captured as a CUDA
// graph), no host synchronisation, no graph walk.
//
// Note [DDP in a CUDA graph]: with one device per process, a DDP step can be
// captured whole (parallel::GraphedStep; chorus train and chorus bench do it
// by default): the bucket all-reduces are recorded into the graph on the NCCL
// group's stream (Note [NCCL in a CUDA graph]) and replayed with it, so a
// replay costs the host one launch however many buckets there are. The
// capture needs the steps before it to have settled the buckets (the rebuild
// from rank 0's order happens on the second step: two warm-up steps) and a
// step that uses every parameter on this rank (an unused one is a host read,
// so the step stays eager, with one line saying so).
//
// Note [DDP buffers]: the module's buffers are re-pointed, once, at views of
// one flat buffer per device and dtype (layers read their buffers through
// their slots, as DataParallel's replicas do), so broadcasting rank 0's
// buffers before each forward is one in-place broadcast per flat buffer.

}  // namespace chorus::dist
