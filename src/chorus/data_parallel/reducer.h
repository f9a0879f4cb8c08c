// The gradient reducer: what turns the replicas' gradients into their
// reduction, bucket by bucket, while the backward still runs. One engine
// (BucketEngine, data_parallel/bucket_engine.h, Note [One reducer engine]: the
// bucket plan GradBuckets, ready counts, launch order, the CommHook's
// reductions, the join, the views) and two front ends over it: the graph
// form below, for replicas inside one process (DataParallel: the autograd
// engine's dependency counts are the ready counts, so unused parameters need
// no pass of their own), and the hook form (data_parallel/grad_hooks.h, Note
// [Reducer hooks]), for one replica per process (DistributedDataParallel:
// persistent buckets, launched in one order on every rank, no_sync
// accumulation). The communication is one CommHook class per strategy
// (data_parallel/comm_hook.h), chosen from the options.
//
// Note [Gradient nodes]: the graph form is part of the autograd graph, not a set
// of hooks. Each forward that records, record() returns, for each replica r
// and parameter k, a fresh alias of the tensor replica r computes with (for
// replica 0 the master itself, detached) whose grad_fn is one node per
// (replica, bucket):
//  - "ReducerReplicaBackward" (on devices[r], so the engine runs it on that
//    device's thread) packs the gradients it received into a fresh flat buffer
//    per dtype (ops::copy_multi; fresh from the stream-ordered allocator, so
//    nothing aliases an earlier step's .grad), zero-filling parameters this
//    replica did not use, and records an Event there;
//  - "ReducerBucketBackward" (on devices[0]) hands the replicas' buffers and
//    events to the CommHook, which issues the sum/all-reduce and returns at
//    once (Note [Overlapped collectives] in cuda/runtime/nccl.h);
//  - one "ReducerJoinBackward" makes the CommHook join devices[0]'s current
//    stream to every bucket's collective, once, and returns a view of the
//    result per master parameter to its AccumulateGrad, which keeps it as
//    .grad without a copy (autograd::mark_owned_view: PyTorch's
//    gradient_as_bucket_view).
//
// Note [Gradients summed where they are]: with replicated updates (an
// all-reducing comm that sums_each()) a large gradient is not packed. Each
// replica node passes each gradient of at least in_place_min_bytes on as it
// is (copying it into a fresh buffer only when something else can see its
// buffer -- two parameters whose gradients are one tensor -- or its layout or
// dtype is not the parameter's: a linear layer's weight gradient, which the
// matrix product writes transposed) and packs the rest, one flat buffer per
// dtype (BucketSplit). A replica that produced any of a bucket's gradients
// fills every slot before the event the sum waits for (zeros for parameters
// it did not use); one that produced none gets zeros and an event of their
// own from the bucket node. The bucket node sums all of them in place with one
// grouped all-reduce (one NCCL group on GPUs), and the sums are the .grad of
// the masters and of the replicas' parameters (views for the packed ones).
// Against packing everything: two passes over every large gradient's bytes
// fewer, and the last bucket's sum starts when the backward's last kernel is
// done instead of after a copy. Small ones stay packed because each tensor in
// an NCCL group costs about a microsecond, which a model of many small
// gradients feels (docs/benchmarks.md has the measurements). Options:
// DataParallelOptions::grads_in_place (false packs them all) and
// in_place_min_bytes; the copy engines, which sum flat buffers, always pack.
//
// Note [Gradient sums in the update]: over two GPUs the sum need not be made
// where the gradients are. The bucket node hands a bucket's gradients to the
// comm's exchange_each (ops::exchange_each_after): each GPU's copy stream
// copies the other GPU's gradients beside its own (DMAs by the copy engines
// over NVLink, once the other's ready event has passed: no kernel, no SM
// held while they travel), and each gradient keeps the copy as its pending
// part (autograd::set_pending_sum). Its value is own + part; the optimizer's
// fused update (SGD, AdamW) adds the part as it reads the gradient, one
// float addition per element -- g0 + g1 on one GPU, g1 + g0 on the other,
// the same bits, so the replicas stay bit-equal -- and anything else that
// reads the gradient adds it first (Tensor::grad(), AccumulateGrad
// accumulating into an earlier gradient, the engine summing two gradients of
// one input: autograd::finish_grad), so no reader sees half a sum (Note
// [Gradient finishers] in autograd/grad_finisher.h). Against NCCL's
// all-reduce beside the backward, whose kernels hold SMs and slow the
// convolutions beside them, the cost is the copy engines' traffic and one
// more read of the gradients in the update (docs/benchmarks.md). Two devices
// only: over n devices each would copy n - 1 gradients (NCCL's ring moves
// two). DataParallelOptions::grad_sum (dist::GradSumMethod): Auto, the
// default, does this on two GPUs with peer access; InUpdate also on two CPU
// devices (a plain copy; tests); Nccl never (data_parallel/in_process_hooks.h).
// All get urgent creation numbers (autograd::next_urgent_sequence_nr), so the
// engine runs them as soon as a bucket's gradients are in. The engine's
// dependency count makes a node wait for exactly the inputs this backward
// reaches: parameters no replica used get no gradient (as for a plain
// module); one only some replicas used is summed over those. That is how
// unused parameters are found with no extra pass over the graph.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "chorus/core/stream.h"
#include "chorus/core/tensor.h"
#include "chorus/data_parallel/bucket_engine.h"
#include "chorus/data_parallel/comm_hook.h"
#include "chorus/data_parallel/grad_buckets.h"

namespace chorus::dist {

// Note [Gradients summed where they are]: which of a bucket's gradients are
// summed where the backward wrote them (`direct`: those of at least
// ReducerOptions::in_place_min_bytes) and which are packed into `small`, one
// flat buffer per dtype. What flows from a replica node to the bucket node:
// one slot per direct gradient, then one per dtype group of `small`.
struct BucketSplit {
  std::vector<size_t> direct;       // bucket indices i (GradBuckets::Bucket::ks[i])
  std::vector<size_t> packed;       // bucket indices i; packed[j] is segment j of `small`
  FlatLayout small;                 // of the packed ones
  std::vector<size_t> slot;         // [i]: its slot
  std::vector<size_t> small_index;  // [i]: j for a packed one
  std::vector<char> direct_of;      // [i]: whether it is direct

  BucketSplit(const GradBuckets::Bucket& bucket, const std::vector<Tensor>& params, int64_t min_bytes);
  size_t slots() const { return direct.size() + small.groups(); }
  bool is_direct(size_t i) const { return direct_of[i] != 0; }
};

// How many large gradients the replica nodes copied so far in this process
// because something else could see their buffer (or their layout or dtype was
// not the parameter's) instead of summing them where they were.
uint64_t in_place_gradient_copies();

struct ReducerOptions {
  int64_t bucket_bytes = int64_t{25} << 20;  // 0: one bucket, reduced at the end
  int64_t first_bucket_bytes = 0;            // 0: as bucket_bytes
  int64_t last_bucket_bytes = 0;             // 0: no tail bucket of its own
  // With a hook that sums_each(): gradients of at least this many bytes are
  // summed where they are, smaller ones packed (Note [Gradients summed where
  // they are]).
  int64_t in_place_min_bytes = int64_t{1} << 20;
};

class Reducer {
 public:
  // `params`: the masters whose gradients are reduced (on devices[0]).
  // Throws ValueError for negative bucket sizes.
  Reducer(std::vector<Tensor> params, std::shared_ptr<CommHook> comm, ReducerOptions options = {});

  // Note [Gradient nodes]: the gradient nodes of one forward over replicas
  // [0, devices.size()), devices[0] being the masters' device; replica_params[r][k]
  // is the tensor replica r holds for parameter k (replica 0: the master). Returns
  // the recorded aliases, same indexing, to put in the replicas' slots for this
  // forward. Call on the thread that runs the forward, before the replicas run.
  //
  // `replica_grads` (only with a CommHook that all_reduces()): for replicas
  // r >= 1, the tensors whose .grad receives replica r's copy of the reduced
  // gradient of parameter k (a view of its bucket, as the masters' are), set
  // by the join node once every device's current stream waits for the
  // collectives (the current streams of the thread calling record(): issue
  // the optimizer's step from it). Empty: the masters alone get the gradients.
  std::vector<std::vector<Tensor>> record(const std::vector<Device>& devices,
                                          const std::vector<std::vector<Tensor>>& replica_params,
                                          const std::vector<std::vector<Tensor>>& replica_grads = {}) const;

  const std::vector<Tensor>& params() const { return params_; }
  const GradBuckets& buckets() const { return engine_->plan(); }
  // Host seconds the join node waited so far (Note [One reducer engine]).
  double join_seconds() const { return engine_->join_seconds(); }

 private:
  std::vector<Tensor> params_;
  std::shared_ptr<BucketEngine> engine_;
  std::shared_ptr<const std::vector<BucketSplit>> split_;  // [bucket]
};

}  // namespace chorus::dist
