// BucketEngine: the one engine of the gradient reducer (Note [One reducer
// engine]); the bucket plan it runs is GradBuckets (data_parallel/grad_buckets.h),
// the communication it drives is a CommHook (data_parallel/comm_hook.h).
//
// Note [One reducer engine]: every data-parallel wrapper turns gradients into
// their reduction the same way -- a bucket is launched once all of its
// parameters' gradients are final, buckets launch in one order, the
// collectives are joined once after the last, and each parameter's .grad
// becomes a view of its segment of the reduced bucket -- and differs only in
// how it learns that a gradient is final. So the engine holds that shared
// part:
//  - ready counts: arm() before a backward, mark_ready(k) as parameter k's
//    gradient becomes final (or k turns out unused), which launches, through
//    the front end's callback, every bucket now complete -- in index order
//    (Order::InOrder: every process must issue its collectives in one order,
//    or they pair up wrongly) or as they complete (Order::AsReady: one
//    process issues each bucket's collective over all its devices at once);
//    not_ready() after the backward names the parameters it did not reach
//    (unused), which the front end marks ready in turn; the first armed
//    backward's order is recorded (ready_order) for rebuilding the buckets;
//  - the reduction of a bucket's buffers through the CommHook (reduce,
//    sum_each, exchange_each);
//  - the join (every device's current stream after the collectives, the host
//    time it took counted: the time this rank waited for the others, Note
//    [Slow ranks named]) and the parameters' views of their buckets.
// The front ends:
//  - one replica per process (DistributedDataParallel: HookReducer,
//    data_parallel/grad_hooks.h): a post-accumulate hook per parameter calls
//    mark_ready; buckets are persistent; Order::InOrder;
//  - replicas inside one process (DataParallel: Reducer, data_parallel/reducer.h):
//    gradient nodes in the autograd graph (Note [Gradient nodes]); the
//    autograd engine's dependency count is the ready count of a bucket's node
//    (one per replica and bucket, then one per bucket), so it reduces each
//    bucket as it completes and learns the unused parameters from the graph
//    with no pass of its own; Order::AsReady;
//  - ZeRO (ShardedDataParallel, data_parallel/sharded.h) counts readiness with
//    the same ready counts and launches reduce-scatters instead of a CommHook.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "chorus/core/stream.h"
#include "chorus/core/tensor.h"
#include "chorus/data_parallel/comm_hook.h"
#include "chorus/data_parallel/grad_buckets.h"

namespace chorus::dist {

// Ready counts and launch order over a bucket plan (Note [One reducer
// engine]). Not thread-safe: the front end holds its lock around each call.
class BucketReadiness {
 public:
  enum class Order { InOrder, AsReady };
  explicit BucketReadiness(Order order = Order::InOrder) : order_(order) {}

  // A new backward over `plan` (kept by reference until the next arm):
  // every parameter pending. Records the ready order while recording().
  void arm(const GradBuckets& plan);
  // Parameter k is ready: launch(b) is called for every bucket this makes
  // launchable, in index order under Order::InOrder. Throws ValueError when
  // k was already ready in this backward.
  void mark_ready(size_t k, const std::function<void(size_t)>& launch);
  bool is_ready(size_t k) const { return ready_[k] != 0; }
  // The parameters not marked ready yet, in index order.
  std::vector<size_t> not_ready() const;
  // Whether every bucket has been launched.
  bool all_launched() const { return launched_ == pending_.size(); }
  // The first complete backward's ready order (empty while it is recorded).
  const std::vector<size_t>& ready_order() const {
    static const std::vector<size_t> none;
    return recording_ ? none : order_seen_;
  }
  bool recording() const { return recording_; }
  // Ends the recording (after the first complete backward, or when the
  // buckets were planned from an order given explicitly).
  void stop_recording() { recording_ = false; }

 private:
  const GradBuckets* plan_ = nullptr;
  Order order_;
  std::vector<char> ready_;        // [k]
  std::vector<size_t> pending_;    // [bucket]: parameters not yet ready
  std::vector<char> launched_of_;  // [bucket] (Order::AsReady)
  size_t next_ = 0;                // Order::InOrder: the next bucket to launch
  size_t launched_ = 0;
  bool recording_ = true;
  std::vector<size_t> order_seen_;
};

// The engine (Note [One reducer engine]): a plan's ready counts, its
// buckets' reductions through the CommHook, the join, the views.
class BucketEngine {
 public:
  BucketEngine(std::shared_ptr<const GradBuckets> plan, std::shared_ptr<CommHook> comm,
               BucketReadiness::Order order);

  const GradBuckets& plan() const { return *plan_; }
  const std::shared_ptr<const GradBuckets>& plan_ptr() const { return plan_; }
  // A new plan (between backwards).
  void set_plan(std::shared_ptr<const GradBuckets> plan);
  CommHook& comm() const { return *comm_; }
  BucketReadiness& readiness() { return readiness_; }
  const BucketReadiness& readiness() const { return readiness_; }

  // One of a bucket's flat buffers reduced over the replicas (bufs[r] on
  // replica r's device, readable once ready[r] has passed): issued without
  // waiting; the result is on bufs[0]'s device (it may be bufs[0] itself).
  Tensor reduce(std::vector<Tensor>& bufs, const std::vector<Event>& ready) { return comm_->reduce(bufs, ready); }
  // Note [Gradients summed where they are] (data_parallel/reducer.h): each of
  // a bucket's slots summed in place over the replicas, or (Note [Gradient
  // sums in the update]) exchanged between two, as the CommHook chooses.
  bool sums_each(size_t replicas) const { return replicas > 1 && comm_->sums_each(); }
  bool exchanges(const std::vector<Device>& devices) const { return comm_->exchanges(devices); }
  void sum_each(std::vector<std::vector<Tensor>>& bufs, const std::vector<Event>& ready) {
    comm_->sum_each(bufs, ready);
  }
  std::vector<std::vector<Tensor>> exchange_each(const std::vector<std::vector<Tensor>>& bufs,
                                                 const std::vector<Event>& ready) {
    return comm_->exchange_each(bufs, ready);
  }

  // Every device's current stream after the collectives issued so far (one
  // wait_gradients trace span); returns the host seconds it took, also added
  // to join_seconds().
  double join(const std::vector<Device>& devices);
  void join_quietly() { comm_->join_quietly(); }
  double join_seconds() const { return join_seconds_; }

  // Parameter k's segment of `flat`, its bucket's buffer of k's dtype group
  // (the reduced result, or the bucket itself).
  Tensor view(size_t k, const Tensor& flat) const;

 private:
  std::shared_ptr<const GradBuckets> plan_;
  std::shared_ptr<CommHook> comm_;
  BucketReadiness readiness_;
  double join_seconds_ = 0;
};

}  // namespace chorus::dist
