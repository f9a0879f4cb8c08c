// SyncBatchNorm: batch normalisation with the statistics of the global batch
// -- the batches of every rank of a process group, and of every replica of a
// DataParallel inside each process -- as PyTorch's nn.SyncBatchNorm. Training
// N ranks with a per-rank batch then equals one process on the concatenated
// batch: outputs, gradients and running statistics.
//
//   auto model = dist::convert_sync_batchnorm(make_model(), pg);  // every BatchNorm2d; same names, same tensors
//   auto dp = std::make_shared<parallel::DataParallel>(model, devices);  // replicas sum among themselves, then over pg
//
// Convert before wrapping the model (DataParallel, DDP): DataParallel wires the
// SyncBatchNorm layers it finds when it is built.
//
// Names: the class lives in chorus::dist, beside the collectives it needs
// (DESIGN.md's layer table puts it in data_parallel/; nn/ may not use it), and is
// also nn::SyncBatchNorm, the name PyTorch users look for (the aliases at the
// end). It derives from nn::BatchNorm2d, so code holding a BatchNorm2d -- the
// models' fused bn_relu, a check for batch-norm layers -- runs either.
//
// Note [SyncBatchNorm]: one training forward, per channel c, on each member:
//  1. local sums in a packed [2C+1] tensor: sum(x), sum(x^2), then the element
//     count (float64 on CPU devices, float32 on GPUs);
//  2. the StatsGroup sums the packed tensors over its members: one collective;
//  3. mean = S1/n, var = S2/n - mean^2 (biased, for normalising); y by the
//     eval-mode batch-norm kernel with (mean, var) as its statistics;
//  4. running_mean and running_var move towards mean and the unbiased
//     var * n/(n-1) of the global count, as PyTorch.
// Unequal batches per member are fine: everything is weighted by the global
// count. The backward mirrors it: the local sum(dy) and sum(dy * xhat) per
// channel, packed and summed by the same group (one collective), then
//   dx = weight * invstd * (dy - SDY/n - xhat * SDYX/n)
// while the weight and bias gradients stay local (sum(dy * xhat), sum(dy)):
// DataParallel and DDP sum those over the replicas and ranks as for any
// parameter. The graph has three nodes per call: the local sums' node (which
// gives dx, dweight, dbias), the group's sum, and the output's node (which
// gives the local backward sums); the packed tensors that pass between them
// are private to this op. Evaluation uses the running statistics and does no
// communication. The sums S2/n - mean^2 lose precision when a channel's mean
// is large against its spread; in float64 on the CPU that is far below float32
// rounding, in float32 on GPUs it is the same trade PyTorch's reduction makes.
//
// Note [SyncBatchNorm ordering]: every member must run the same SyncBatchNorm
// calls in the same order, forward and backward, as for any collective. A
// rank whose loss does not reach a SyncBatchNorm layer that the others'
// losses reach leaves them waiting until the group's timeout (DistError). The
// all-reduces share the process group's sequence with whatever else uses it
// (DDP's gradient buckets); both are issued by the backward in graph order,
// which is the same on every rank for a single-device module. Where a
// DataParallel inside each process lets two branches' SyncBatchNorm backwards
// become ready at once (two batch norms in parallel branches), their order can
// differ between processes: give SyncBatchNorm its own group then, one per
// branch (pg->new_group with every rank).
#pragma once

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "chorus/distributed/process_group.h"
#include "chorus/nn/layers.h"

namespace chorus::dist {

// Where statistics are summed: each member passes its local tensor and gets
// the sum over every member back.
class StatsGroup {
 public:
  virtual ~StatsGroup() = default;
  // The sum of `local` (1-d, contiguous) over every member, on local's
  // device. Differentiable: the gradient reaching a member's `local` is the
  // sum over the members of the gradients reaching their results. Every
  // member calls it once per sum, all in the same order.
  virtual Tensor sum(const Tensor& local, int member) = 0;
};
using StatsGroupPtr = std::shared_ptr<StatsGroup>;

// The ranks of a process group (member: ignored, one per process): one
// all_reduce forward, one backward (Gloo for CPU tensors, NCCL for CUDA ones,
// on the group's device).
class ProcessStatsGroup final : public StatsGroup {
 public:
  explicit ProcessStatsGroup(ProcessGroupPtr process_group);
  Tensor sum(const Tensor& local, int member) override;
  const ProcessGroupPtr& process_group() const { return pg_; }

 private:
  ProcessGroupPtr pg_;
};

// The replicas of one process, one member per device (DataParallel builds one
// per SyncBatchNorm layer), then across processes through `across` when given.
// The members meet in the forward (each on its own thread; the last to arrive
// sums on the first member's device and runs `across`); the backward needs no
// meeting: one graph node on the first member's device takes every member's
// gradient (the engine waits for them) and sums those.
class ReplicaStatsGroup final : public StatsGroup {
 public:
  // A member that waits longer than `timeout` for the others throws DistError.
  ReplicaStatsGroup(int members, StatsGroupPtr across, std::chrono::milliseconds timeout = std::chrono::seconds(300));
  Tensor sum(const Tensor& local, int member) override;

  int members() const { return members_; }
  // DataParallel, around each forward: members [0, active) take part (fewer
  // replicas for a small batch). Outside begin/end member 0 sums alone (then
  // across): the wrapped module used on its own.
  void begin(int active);
  void end();
  // Members waiting for the others (now or later, until end()) throw Error
  // carrying `why`: a replica failed before reaching the sum.
  void abort(const std::string& why);

 private:
  struct Round;
  TensorList combine(const std::vector<Tensor>& locals);

  const int members_;
  const StatsGroupPtr across_;
  const std::chrono::milliseconds timeout_;
  std::mutex mu_;
  std::condition_variable cv_;
  int active_ = 1;
  std::shared_ptr<Round> round_;  // the sum members are arriving at
  std::string aborted_;           // non-empty: abort() was called
};

struct SyncBatchNormOptions {
  int64_t features;
  double eps = 1e-5, momentum = 0.1;
  bool affine = true;
  // The ranks whose batches make up the global batch; null: this process only
  // (its DataParallel replicas, or its own batch alone).
  ProcessGroupPtr process_group;
};

// Training-mode SyncBatchNorm as a function (Note [SyncBatchNorm]): x [N, C]
// or [N, C, H, W]; the running statistics (when defined) are updated in place.
// group null: this call's batch alone.
Tensor sync_batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                       const Tensor& bias, double momentum, double eps, StatsGroup* group, int member);

class SyncBatchNorm : public nn::BatchNorm2d {
 public:
  explicit SyncBatchNorm(SyncBatchNormOptions o);
  explicit SyncBatchNorm(int64_t features, ProcessGroupPtr process_group = nullptr)
      : SyncBatchNorm(SyncBatchNormOptions{features, 1e-5, 0.1, true, std::move(process_group)}) {}

  const ProcessGroupPtr& process_group() const { return opts_.process_group; }
  // Where this layer's statistics are summed, as member `member`. By default
  // its process group's ranks (or nothing to sum with). DataParallel sets a
  // ReplicaStatsGroup on each of its replicas' layers.
  void set_stats_group(StatsGroupPtr group, int member);
  const StatsGroupPtr& stats_group() const { return group_; }
  int stats_member() const { return member_; }

  std::string extra_repr() const override;
  SyncBatchNormOptions options_for_clone() const { return opts_; }
  CHORUS_MODULE_CLONEABLE(SyncBatchNorm)

 protected:
  Tensor run(const Tensor& x, bool relu) override;

 private:
  SyncBatchNormOptions opts_;
  StatsGroupPtr group_;
  int member_ = 0;
};

// `module` with every BatchNorm2d in its tree replaced by a SyncBatchNorm over
// `process_group` that holds the same parameter and buffer tensors under the
// same names (state_dict unchanged; an optimizer built earlier still holds
// them) and the same options and train/eval mode. Returns the new root when
// `module` itself is a BatchNorm2d, else `module` (changed in place).
// SyncBatchNorm layers already there are kept; a BatchNorm2d registered in
// two places becomes one SyncBatchNorm in both.
nn::ModulePtr convert_sync_batchnorm(nn::ModulePtr module, ProcessGroupPtr process_group = nullptr);

}  // namespace chorus::dist

namespace chorus::nn {
using dist::convert_sync_batchnorm;
using dist::SyncBatchNorm;
using dist::SyncBatchNormOptions;
}  // namespace chorus::nn
