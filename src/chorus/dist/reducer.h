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
// All get urgent creation numbers (autograd::next_urgent_sequence_nr), so the
// engine runs them as soon as a bucket's gradients are in. The engine's
// dependency count makes a node wait for exactly the inputs this backward
// reaches: parameters no replica used get no gradient (as for a plain
// module); one only some replicas used is summed over those. That is how
// unused parameters are found with no extra pass over the graph.
#pragma once

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
};

struct ReducerOptions {
  int64_t bucket_bytes = int64_t{25} << 20;  // 0: one bucket, reduced at the end
  int64_t first_bucket_bytes = 0;            // 0: as bucket_bytes
  int64_t last_bucket_bytes = 0;             // 0: no tail bucket of its own
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
};

}  // namespace chorus::dist
