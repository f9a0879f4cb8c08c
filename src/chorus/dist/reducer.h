// The gradient reducer: one for DataParallel (sums over the devices of this
// process) and DistributedDataParallel (all-reduce over a process group), as
// PyTorch's DDP and its Reducer are separate. What differs between them is
// only how one bucket's buffers become their sum: the BucketComm. This file
// is the graph form (DataParallel's); the per-parameter form DDP hangs on
// post-accumulate hooks is dist/grad_hooks.h (Note [Reducer hooks]).
//
// Note [Gradient buckets]: the parameters' gradients travel in buckets of
// about `bucket_bytes` (25 MiB by default), filled from the last parameter to
// the first — the order in which a backward pass usually produces their
// gradients — so the sum of the last layers' gradients travels while the
// first layers' are still being computed, instead of the whole model's after
// the last backward op. `first_bucket_bytes` (when smaller) closes the first
// bucket early so that communication starts as soon as possible;
// `last_bucket_bytes` (when > 0) gives the last parameters to fill (the first
// layers) a bucket of their own of at most that size, since what the last
// bucket carries is sent after the backward's last op, with nothing left to
// hide it behind (on 2 H100s a 21 MB last bucket of WRN-28-10 was a 62 µs
// tail, Note [Memset nodes in a graph]'s trace); the bucket before it closes
// early enough for its sum to overlap the first layers' backward.
//
// Note [Gradient nodes]: the reducer is part of the autograd graph, not a set
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
//    events to the BucketComm, which issues the sum/all-reduce and returns at
//    once (Note [Overlapped collectives] in cuda/nccl.h);
//  - one "ReducerJoinBackward" makes the BucketComm join devices[0]'s current
//    stream to every bucket's collective, once, and returns a view of the
//    result per master parameter to its AccumulateGrad, which keeps it as
//    .grad without a copy (TensorImpl::exclusive_view: PyTorch's
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
// fewer (146 MB written and read per GPU and step for WRN-28-10), and the last
// bucket's sum starts when the backward's last kernel is done instead of
// after a copy. Small ones stay packed because each tensor in an NCCL group
// costs about a microsecond: with every one of WRN-16-4's ~50 gradients in
// place its 2-GPU efficiency fell from 0.92-0.93 to 0.90, while WRN-28-10's
// rose from 0.936-0.952 to 0.946-0.960 (2 H100s, bf16, graphed; 1 MiB: both
// kept their best). CHORUS_DP_GRADS=packed packs them all; the copy engines,
// which sum flat buffers, always do.
//
// Note [Gradient sums in the update]: over two GPUs the sum need not be made
// where the gradients are. The bucket node hands a bucket's gradients to the
// comm's exchange_each (ops::exchange_each_after): each GPU's copy stream
// copies the other GPU's gradients beside its own (DMAs by the copy engines
// over NVLink, once the other's ready event has passed: no kernel, no SM
// held while they travel), and each gradient keeps the copy as its pending
// part (TensorImpl::sum_pending). Its value is own + part; the optimizer's
// fused update (SGD, AdamW) adds the part as it reads the gradient, one
// float addition per element -- g0 + g1 on one GPU, g1 + g0 on the other,
// the same bits, so the replicas stay bit-equal -- and anything else that
// reads the gradient adds it first (Tensor::grad(), AccumulateGrad
// accumulating into an earlier gradient, the engine summing two gradients of
// one input: autograd::settle_sum), so no reader sees half a sum. Against
// NCCL's all-reduce beside the backward, whose kernels hold 24 of 132 SMs
// and slow the convolutions beside them by up to 60%, the cost is the copy
// engines' traffic and one more read of the gradients in the update (WRN-28-10
// bf16, 2 H100s: 2-GPU efficiency 0.948-0.952 with NCCL, 0.960-0.961 this
// way; docs/benchmarks.md, session 21). Two devices only: over n devices each
// would copy n - 1 gradients (NCCL's ring moves two). CHORUS_DP_ALLREDUCE /
// --dp-all-reduce: auto (the default) does this on two GPUs with peer access,
// in-update also on two CPU devices (a plain copy; tests), nccl never.
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
#include "chorus/dist/flat_layout.h"

namespace chorus::dist {

// The parameters' gradients in buckets (Note [Gradient buckets]), each with
// its own flat layout. Bucket 0 holds the last parameters. A bucket holds the
// parameters of one device (a module spread over devices gets a bucket chain
// per stretch of parameters on one device).
struct GradBuckets {
  struct Bucket {
    std::vector<size_t> ks;  // parameter indices, last parameters first
    FlatLayout layout;       // of their gradients, segment i for ks[i]
  };
  std::vector<Bucket> buckets;
  std::vector<size_t> bucket_of, index_in_bucket;  // [k]

  // bucket_bytes 0: one bucket. first_bucket_bytes 0: as bucket_bytes.
  // `order`: the parameter indices in the order to fill the buckets (each
  // once: the order gradients became ready, dist/grad_hooks.h); empty: from
  // the last parameter to the first. ValueError if it is not a permutation.
  // last_bucket_bytes 0: no separate tail bucket.
  GradBuckets(const std::vector<Tensor>& params, int64_t bucket_bytes, int64_t first_bucket_bytes = 0,
              const std::vector<size_t>& order = {}, int64_t last_bucket_bytes = 0);
};

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

// How one bucket's per-replica buffers become the reduced gradient.
class BucketComm {
 public:
  virtual ~BucketComm() = default;
  // srcs[r]: replica r's flat buffer of one dtype (contiguous, on its device),
  // readable once ready[r] has passed. Issues the reduction without waiting
  // for it and returns the result, on srcs[0]'s device (it may be srcs[0]).
  virtual Tensor reduce(std::vector<Tensor>& srcs, const std::vector<Event>& ready) = 0;
  // Work issued to `device`'s current stream after this waits for every
  // reduce() so far.
  virtual void join(const Device& device) = 0;
  // After a failure: waits for what was issued, swallowing its errors.
  virtual void join_quietly() {}
  // Whether reduce() leaves the sum in every srcs[r] (an all-reduce), so that
  // each replica can take its own copy of the gradients (Note [Replicated
  // updates] in parallel/data_parallel.h).
  virtual bool all_reduces() const { return false; }
  // Whether sum_each() is to be used instead of reduce() (Note [Gradients
  // summed where they are]); an all-reducing comm only.
  virtual bool sums_each() const { return false; }
  // grads[i][r]: replica r's gradient of one of a bucket's parameters (dense,
  // on the r-th replica's device, nobody else's), readable once ready[r] has
  // passed; each is replaced by the sum over the replicas, in place, issued
  // without waiting (join() orders later work after it).
  virtual void sum_each(std::vector<std::vector<Tensor>>& grads, const std::vector<Event>& ready);
  // Note [Gradient sums in the update]: whether, over `devices`, the sum is
  // left to the optimizer: exchange_each() instead of sum_each().
  virtual bool exchanges(const std::vector<Device>& devices) const { (void)devices; return false; }
  // As sum_each, but each grads[i][r] is left as it is and the result's
  // [i][r] is a copy of the other replica's grads[i][1 - r] on replica r's
  // device (ops::exchange_each_after), to be its pending part.
  virtual std::vector<std::vector<Tensor>> exchange_each(const std::vector<std::vector<Tensor>>& grads,
                                                         const std::vector<Event>& ready);
};

// DataParallel's BucketComm: the sum over the devices of this process
// (ops::reduce_sum_after: one NCCL reduce on GPUs, copies and adds elsewhere,
// in replica order on CPU devices so results do not depend on thread timing).
class InProcessSum final : public BucketComm {
 public:
  Tensor reduce(std::vector<Tensor>& srcs, const std::vector<Event>& ready) override;
  void join(const Device& device) override;
};

// The same sum left on every device (ops::all_reduce_sum_after: one NCCL
// all-reduce on GPUs), for DataParallel's replicated updates.
class InProcessAllReduce final : public BucketComm {
 public:
  Tensor reduce(std::vector<Tensor>& srcs, const std::vector<Event>& ready) override;
  void join(const Device& device) override;
  bool all_reduces() const override { return true; }
  // In place (ops::all_reduce_sum_each_after) unless CHORUS_DP_GRADS=packed,
  // or the copy engines sum (they need the flat buffers).
  bool sums_each() const override;
  void sum_each(std::vector<std::vector<Tensor>>& grads, const std::vector<Event>& ready) override;
  // ops::exchange_applies (CHORUS_DP_ALLREDUCE: in-update, or auto on two GPUs).
  bool exchanges(const std::vector<Device>& devices) const override;
  std::vector<std::vector<Tensor>> exchange_each(const std::vector<std::vector<Tensor>>& grads,
                                                 const std::vector<Event>& ready) override;
};

// Whether DataParallel's replicated updates sum each gradient where the
// backward wrote it (CHORUS_DP_GRADS=in-place, the default) or pack them into
// flat buckets first (CHORUS_DP_GRADS=packed); ValueError for anything else.
// The setter overrides the environment (tests, A/B runs); a forward records
// with the setting of its time.
bool in_place_gradient_sums();
void set_in_place_gradient_sums(bool on);
// How many large gradients the replica nodes copied so far in this process
// because something else could see their buffer (or their layout or dtype was
// not the parameter's) instead of summing them where they were.
uint64_t in_place_gradient_copies();
// The default of ReducerOptions / DataParallelOptions::in_place_min_bytes:
// CHORUS_DP_GRADS_MIN_BYTES where set (ValueError if it is not a number of
// bytes), else 1 MiB. An explicit value in the options wins.
int64_t default_in_place_min_bytes();

struct ReducerOptions {
  int64_t bucket_bytes = int64_t{25} << 20;  // 0: one bucket, reduced at the end
  int64_t first_bucket_bytes = 0;            // 0: as bucket_bytes
  int64_t last_bucket_bytes = 0;             // 0: no tail bucket of its own
  // With a comm that sums_each(): gradients of at least this many bytes are
  // summed where they are, smaller ones packed (Note [Gradients summed where
  // they are]).
  int64_t in_place_min_bytes = default_in_place_min_bytes();
};

class Reducer {
 public:
  // `params`: the masters whose gradients are reduced (on devices[0]).
  // Throws ValueError for negative bucket sizes.
  Reducer(std::vector<Tensor> params, std::shared_ptr<BucketComm> comm, ReducerOptions options = {});

  // Note [Gradient nodes]: the gradient nodes of one forward over replicas
  // [0, devices.size()), devices[0] being the masters' device; replica_params[r][k]
  // is the tensor replica r holds for parameter k (replica 0: the master). Returns
  // the recorded aliases, same indexing, to put in the replicas' slots for this
  // forward. Call on the thread that runs the forward, before the replicas run.
  //
  // `replica_grads` (only with a BucketComm that all_reduces()): for replicas
  // r >= 1, the tensors whose .grad receives replica r's copy of the reduced
  // gradient of parameter k (a view of its bucket, as the masters' are), set
  // by the join node once every device's current stream waits for the
  // collectives (the current streams of the thread calling record(): issue
  // the optimizer's step from it). Empty: the masters alone get the gradients.
  std::vector<std::vector<Tensor>> record(const std::vector<Device>& devices,
                                          const std::vector<std::vector<Tensor>>& replica_params,
                                          const std::vector<std::vector<Tensor>>& replica_grads = {}) const;

  const std::vector<Tensor>& params() const { return params_; }
  const GradBuckets& buckets() const { return *buckets_; }

 private:
  std::vector<Tensor> params_;
  std::shared_ptr<BucketComm> comm_;
  std::shared_ptr<const GradBuckets> buckets_;
  std::shared_ptr<const std::vector<BucketSplit>> split_;  // [bucket]
};

}  // namespace chorus::dist
