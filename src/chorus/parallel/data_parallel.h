// DataParallel: one model, several devices, one process (Torch7's
// DataParallelTable, PyTorch's nn.DataParallel).
//
// Note [DataParallel replicas]: replicas are built once, at construction; the
// wrapped module itself is the replica on the first device. Each forward:
//  1. replicas whose copy is stale (a master parameter or buffer changed: the
//     optimizer or a batch-norm update bumped its version) receive the
//     master's values — users never call syncParameters;
//  2. every tensor of the input (a tensor or nested lists/maps) is split along
//     `dim` into as-equal-as-possible chunks, one per replica (fewer replicas
//     when the batch is smaller than the device count);
//  3. each replica runs forward on its own host thread (DeviceThreads), under
//     the caller's grad mode and autocast;
//  4. outputs are concatenated on the output device, or returned per replica.
//
// Note [DataParallel flat buffers]: the per-tensor host work is what limits
// scaling (a ResNet has ~100 parameters; one cross-device copy, event and
// graph node each, per replica, per step, all issued from one thread), so
// parameters and gradients move as flat buffers, one collective each
// (ops/comm.h: NCCL on GPUs):
//  - Each replica r >= 1 keeps one flat buffer per dtype on devices[r]; its
//    parameter and buffer slots are views into it. The master values are
//    packed into a staging buffer on devices[0] (one ops::copy_multi per
//    dtype: a few kernel launches, not one per tensor) and
//    broadcast_coalesced to every used replica: one collective per dtype.
//  - Gradients: one autograd node per replica and bucket ("DataParallelReplicaBackward",
//    on devices[r], so the engine runs it on that device's thread) owns the
//    replica's parameter views — for replica 0, detached aliases of the
//    masters, put in the wrapped module's slots for the forward only. Its
//    backward packs the gradients it received (ops::copy_multi) into a fresh
//    flat buffer (from the stream-ordered allocator, so nothing aliases an
//    earlier step's .grad). One "DataParallelReduceBackward" node per bucket on
//    devices[0] takes the replicas' buffers as its inputs and sums them (one
//    collective per dtype, ops::reduce_sum_after); one
//    "DataParallelJoinBackward" node returns a view of the sums per master
//    parameter, to the masters' AccumulateGrad, which keeps it as .grad
//    without a copy (TensorImpl::exclusive_view). The engine's dependency
//    count makes it wait for exactly the replica nodes this backward reaches
//    (a per-replica loss may use only some of them). A parameter no replica
//    produced a gradient for gets none; one that only some replicas used is
//    summed over those.
//  - A forward on one replica only (one device, or a batch of one) uses the
//    masters directly, as a plain module would: nothing to broadcast or sum.
// Replica gradients are summed in replica order on CPU devices, so results do
// not depend on thread timing (NCCL fixes its own order).
//
// Note [DataParallel gradient buckets]: the gradient nodes above exist once
// per bucket of parameters (options.bucket_bytes, 25 MiB by default, filled
// from the last parameter to the first, the order in which a backward pass
// usually produces their gradients), like DistributedDataParallel's buckets.
// All of them get urgent creation numbers, so the engine runs them as soon as
// a bucket's gradients are in: the sum of the last layers' gradients travels
// while the replicas are still computing the first layers', instead of the
// whole model's after the last backward op. Each replica node records an event
// once its bucket is packed and the bucket's sum waits only for those events
// (Note [Overlapped collectives] in cuda/nccl.h); the join node makes
// devices[0]'s stream wait for the sums once, at the end.
//
// BatchNorm: each replica normalises with its own chunk's statistics; the
// running statistics of the first device's replica (the wrapped module) are the
// ones kept, and the other replicas receive them whenever they changed
// (PyTorch's behaviour; use SyncBatchNorm-style global statistics via DDP
// instead).
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "chorus/nn/module.h"
#include "chorus/parallel/device_threads.h"

namespace chorus::parallel {

namespace detail {
struct FlatLayout;   // where each of a list of tensors lives in its dtype's flat buffer
struct GradBuckets;  // the parameters' gradients in buckets, each with its own flat layout
}

struct DataParallelOptions {
  int64_t dim = 0;                       // the batch dimension of every input tensor
  std::optional<Device> output_device;   // default: the first device
  bool gather_output = true;             // false: per-replica outputs, left on their devices
  // Gradients are summed across replicas in buckets of about this many bytes
  // (Note [DataParallel gradient buckets]); 0: one bucket, summed at the end.
  // Negative: ValueError.
  int64_t bucket_bytes = int64_t{25} << 20;
};

class DataParallel : public nn::Module {
 public:
  // Throws ValueError for an empty device list, a repeated device, a module
  // whose parameters are not all on the first device, or a negative bucket size.
  DataParallel(nn::ModulePtr module, std::vector<Device> devices, DataParallelOptions options = {});
  ~DataParallel() override;

  // Single tensor in, single tensor out (gathered on the output device).
  Tensor forward(const Tensor& x) override;
  // Nested inputs; with gather_output=false the result is a list with one
  // output per replica used.
  nn::Value forward_value(const nn::Value& x) override;

  const nn::ModulePtr& module() const { return module_; }
  const std::vector<Device>& devices() const { return devices_; }
  // The replica on devices()[i] (0 is module()).
  nn::ModulePtr replica(size_t i) const { return replicas_.at(i); }

 protected:
  std::shared_ptr<nn::Module> make_empty() const override;

 private:
  struct Entry;  // one master parameter or buffer and its slots in each replica
  void sync_replicas(size_t used);
  // Records the gradient nodes of replicas [0, used) and puts their recorded
  // parameter views in the replicas' slots (replica 0's until restore_masters).
  void record_gradient_nodes(size_t used);
  void restore_masters();
  int64_t batch_size(const nn::Value& x) const;
  nn::Value scatter(const nn::Value& x, int64_t start, int64_t len, const Device& d) const;
  nn::Value gather(const std::vector<nn::Value>& outs, const Device& d) const;

  nn::ModulePtr module_;
  std::vector<Device> devices_;
  DataParallelOptions options_;
  std::vector<nn::ModulePtr> replicas_;
  std::vector<Entry> entries_;                  // parameters first, then buffers
  size_t num_params_ = 0;
  std::shared_ptr<const detail::FlatLayout> layout_;       // of every entry
  std::vector<Tensor> staging_;                            // [group] on devices_[0]
  std::vector<Tensor> staging_views_;                      // [entry] views into staging_
  std::vector<std::vector<Tensor>> flat_;                  // [replica][group] (replica 0: none)
  std::vector<std::vector<Tensor>> views_;                 // [replica][entry] views into flat_
  std::vector<size_t> grad_entries_;                       // the entries grad_buckets_ covers
  std::shared_ptr<const detail::GradBuckets> grad_buckets_;  // of their gradients
  std::unique_ptr<DeviceThreads> threads_;
  bool grad_enabled_outside_ = true;
};

}  // namespace chorus::parallel
