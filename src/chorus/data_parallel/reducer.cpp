#include "chorus/data_parallel/reducer.h"

#include <atomic>
#include <string>

#include "chorus/autograd/grad_mode.h"
#include "chorus/autograd/node.h"
#include "chorus/autograd/side_work.h"
#include "chorus/autograd/grad_finisher.h"
#include "chorus/core/error.h"
#include "chorus/ops/comm.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/elementwise.h"
#include "chorus/ops/factory.h"

namespace chorus::dist {

BucketSplit::BucketSplit(const GradBuckets::Bucket& bucket, const std::vector<Tensor>& params, int64_t min_bytes)
    : slot(bucket.ks.size()), small_index(bucket.ks.size(), 0), direct_of(bucket.ks.size(), 0) {
  std::vector<Tensor> small_params;
  for (size_t i = 0; i < bucket.ks.size(); ++i) {
    const Tensor& p = params[bucket.ks[i]];
    if (static_cast<int64_t>(p.nbytes()) >= min_bytes) {
      direct_of[i] = 1;
      slot[i] = direct.size();
      direct.push_back(i);
    } else {
      small_index[i] = packed.size();
      packed.push_back(i);
      small_params.push_back(p);
    }
  }
  small = FlatLayout(small_params);
  for (size_t j = 0; j < packed.size(); ++j) slot[packed[j]] = direct.size() + small.segments[j].group;
}

namespace {
std::atomic<uint64_t>& gradients_copied() {
  static std::atomic<uint64_t> n{0};
  return n;
}
}  // namespace

uint64_t in_place_gradient_copies() { return gradients_copied().load(); }

namespace {

// What one forward's gradient nodes share (Note [Gradient nodes]).
struct GradStep {
  // Note [One reducer engine]: the plan, the CommHook, the join.
  std::shared_ptr<BucketEngine> engine;
  std::vector<Device> devices;  // of the replicas, in order
  // [replica][k]: whether the replica's last backward produced a gradient for
  // parameter k. Each replica node writes its own bucket's entries of its own
  // row on its device's thread; the bucket node reads them after the engine
  // has handed it their outputs (the handover synchronises: Note [Engine
  // locking]), which orders the accesses.
  std::vector<std::vector<char>> got;
  // [bucket][replica]: recorded on the replica's stream once its buffers of
  // the bucket are written, by the replica node; read by the bucket node.
  std::vector<std::vector<std::optional<Event>>> ready;
  // [k]: whether any replica sent parameter k; written and read on
  // devices[0]'s thread (bucket nodes, then the join node).
  std::vector<char> summed;
  // With an all-reducing comm and replica_grads: [replica][k] the tensors
  // whose .grad gets replica r's copy (r >= 1), and [bucket][group][replica]
  // the reduced buffers, written by the bucket nodes, read by the join node
  // (both on devices[0]'s thread).
  std::vector<std::vector<Tensor>> replica_grads;
  std::vector<std::vector<std::vector<Tensor>>> results;
  // [k]: the masters (with replica_grads): whether a master already has a
  // gradient when the join node runs (before its AccumulateGrad) says whether
  // the replicas accumulate too.
  std::vector<Tensor> masters;
  // Note [Gradients summed where they are]: the replica nodes pass the large
  // gradients on as they are and pack the small ones (one input of the bucket
  // node per replica and slot: BucketSplit), the bucket node sums them all in
  // place, and results[bucket][slot][replica] holds the sums (all_reduces
  // only). Null: every gradient packed.
  std::shared_ptr<const std::vector<BucketSplit>> split;
  bool each = false;
  // Note [Gradient sums in the update]: with `each`, over two devices whose
  // comm exchanges the gradients instead of summing them.
  bool exchange = false;
  // [replica]: the recording thread's current stream of each device, the one
  // the caller's later work there (the optimizer's update of a replica) runs
  // on: the join node, on devices[0]'s thread, makes it wait for the sums.
  std::vector<Stream> caller_streams;
};

// Replica r's gradients of one bucket's parameters -> one flat buffer per
// dtype, on devices[r], for the bucket's node.
class ReplicaBackward final : public autograd::Node {
 public:
  ReplicaBackward(std::shared_ptr<GradStep> step, size_t replica, size_t bucket)
      : step_(std::move(step)), replica_(replica), bucket_(bucket) {}
  std::string name() const override { return "ReducerReplicaBackward"; }
  // Note [Weight gradients beside the data gradient]: what it copies waits
  // for the side stream (a join); what it passes on as it is, only through
  // the bucket's ready event, so the replica's stream goes on meanwhile.
  bool orders_beside_reads() const override { return true; }

  TensorList apply(TensorList&& grads) override {
    if (step_->each) return pass_on(std::move(grads));
    const GradBuckets::Bucket& bucket = step_->engine->plan().buckets[bucket_];
    const FlatLayout& layout = bucket.layout;
    const size_t groups = layout.groups();
    std::vector<char>& got = step_->got[replica_];
    std::vector<size_t> present(groups, 0), total(groups, 0);
    for (size_t i = 0; i < bucket.ks.size(); ++i) {
      const bool has = i < grads.size() && grads[i].defined();
      got[bucket.ks[i]] = has;
      const size_t g = layout.segments[i].group;
      ++total[g];
      if (has) ++present[g];
    }
    // Zeroed when a parameter got no gradient in this replica (others may have).
    const Device dev = step_->devices[replica_];
    TensorList out(groups);
    bool any = false;
    for (size_t g = 0; g < groups; ++g) {
      if (present[g] == 0) continue;  // undefined: this replica sends nothing for this dtype
      const TensorOptions opts(layout.dtypes[g], dev);
      out[g] = present[g] == total[g] ? empty({layout.numels[g]}, opts) : zeros({layout.numels[g]}, opts);
      any = true;
    }
    std::vector<size_t> all(bucket.ks.size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = i;
    pack(grads, all, layout, out);
    if (any) ready_here();
    return out;
  }

 private:
  // The point the bucket's reduction waits for on this device (Note
  // [Overlapped collectives] in cuda/runtime/nccl.h), not the end of the backward.
  void ready_here() {
    Event done(step_->devices[replica_], /*timing=*/false);
    if (std::optional<Stream> both = autograd::beside_merge(step_->devices[replica_])) done.record(*both);
    else done.record();
    step_->ready[bucket_][replica_] = std::move(done);
  }

  // Note [Gradients summed where they are]: a large gradient goes on as it
  // is when nothing else can see it (the engine handed over the only handle
  // to a buffer of the parameter's own shape, layout and dtype); one that
  // something else can see (a view of a buffer another gradient shares), or
  // of another layout or dtype, is copied into a fresh buffer, which the sum
  // may then write. The small ones are packed, one flat buffer per dtype.
  TensorList pass_on(TensorList&& grads) {
    const GradBuckets::Bucket& bucket = step_->engine->plan().buckets[bucket_];
    const BucketSplit& split = (*step_->split)[bucket_];
    const FlatLayout& layout = bucket.layout;
    std::vector<char>& got = step_->got[replica_];
    const Device dev = step_->devices[replica_];
    TensorList out(split.slots());
    bool any = false;
    for (size_t i = 0; i < bucket.ks.size(); ++i) {
      got[bucket.ks[i]] = i < grads.size() && grads[i].defined();
      any = any || got[bucket.ks[i]];
    }
    // A replica that sends anything fills every slot (zeros for what it did
    // not produce) before its event: the bucket node's one grouped sum waits
    // for that event alone, so zeros it made itself would not be ordered
    // before the sum. (A replica that sends nothing gets zeros and an event of
    // their own from the bucket node.)
    if (!any) return out;
    for (size_t d = 0; d < split.direct.size(); ++d) {
      const size_t i = split.direct[d];
      const FlatLayout::Segment& seg = layout.segments[i];
      const TensorOptions opts(layout.dtypes[seg.group], dev);
      if (!got[bucket.ks[i]]) {
        out[d] = chorus::detail::make_view(zeros({numel_of(seg.sizes)}, opts), seg.sizes, seg.strides, 0);
        continue;
      }
      Tensor g = std::move(grads[i]);
      // The whole of a storage nothing else refers to (a view of part of one
      // would pin the rest as .grad).
      const bool own = g.impl_ptr().use_count() == 1 && g.storage().use_count() == 1 && g.storage_offset() == 0 &&
                       g.nbytes() == g.storage()->nbytes() && g.device() == dev && g.sizes() == seg.sizes &&
                       g.strides() == seg.strides && g.dtype() == layout.dtypes[seg.group];
      if (!own) {
        autograd::join_beside_for(g);
        Tensor fresh = chorus::detail::make_view(empty({numel_of(seg.sizes)}, opts), seg.sizes, seg.strides, 0);
        ops::copy_(fresh, g);
        g = std::move(fresh);
        gradients_copied().fetch_add(1);
      }
      out[d] = std::move(g);
    }
    // The small ones as the packed path packs them, zeros for those this
    // replica did not produce.
    const FlatLayout& small = split.small;
    std::vector<size_t> present(small.groups(), 0), total(small.groups(), 0);
    for (size_t j = 0; j < split.packed.size(); ++j) {
      const size_t g = small.segments[j].group;
      ++total[g];
      if (got[bucket.ks[split.packed[j]]]) ++present[g];
    }
    for (size_t g = 0; g < small.groups(); ++g) {
      const TensorOptions opts(small.dtypes[g], dev);
      out[split.direct.size() + g] = present[g] == total[g] ? empty({small.numels[g]}, opts) : zeros({small.numels[g]}, opts);
    }
    pack(grads, split.packed, small, TensorList(out.begin() + static_cast<std::ptrdiff_t>(split.direct.size()), out.end()));
    ready_here();
    return out;
  }

  // Gradient which[j] (a bucket index) -> segment j of `layout` in flats[its
  // group], for those this replica produced: one multi-tensor copy for the
  // gradients of the parameter's own shape and dtype (Note [Multi-tensor
  // copy] in ops/copy.h); anything else converts.
  void pack(const TensorList& grads, const std::vector<size_t>& which, const FlatLayout& layout,
            const TensorList& flats) const {
    const GradBuckets::Bucket& bucket = step_->engine->plan().buckets[bucket_];
    const std::vector<char>& got = step_->got[replica_];
    TensorList srcs, dsts;
    for (size_t j = 0; j < which.size(); ++j) {
      const size_t i = which[j];
      if (!got[bucket.ks[i]]) continue;
      autograd::join_beside_for(grads[i]);  // read here, on the replica's stream
      Tensor dst = layout.view(flats[layout.segments[j].group], j);
      if (grads[i].sizes() == dst.sizes() && grads[i].dtype() == dst.dtype()) {
        srcs.push_back(grads[i]);
        dsts.push_back(std::move(dst));
      } else {
        ops::copy_(dst, grads[i]);
      }
    }
    ops::copy_multi(srcs, dsts);
  }


  std::shared_ptr<GradStep> step_;
  size_t replica_, bucket_;
};

// The replicas' flat buffers of one bucket -> the CommHook's result, one
// buffer per dtype on devices[0], for the join node. Input r * groups + g is
// replica r's buffer of dtype group g. Issued at once; nothing waits here.
class BucketBackward final : public autograd::Node {
 public:
  BucketBackward(std::shared_ptr<GradStep> step, size_t bucket) : step_(std::move(step)), bucket_(bucket) {}
  std::string name() const override { return "ReducerBucketBackward"; }
  // Its reductions wait for the replicas' ready events, which follow their
  // side streams too (ReplicaBackward::ready_here).
  bool orders_beside_reads() const override { return true; }

  TensorList apply(TensorList&& grads) override {
    if (step_->each) return sum_each(std::move(grads));
    const GradBuckets::Bucket& bucket = step_->engine->plan().buckets[bucket_];
    const FlatLayout& layout = bucket.layout;
    const size_t groups = layout.groups(), replicas = step_->devices.size();
    TensorList out(groups);
    for (size_t g = 0; g < groups; ++g) {
      auto sent = [&](size_t r) { return r * groups + g < grads.size() && grads[r * groups + g].defined(); };
      bool any = false;
      for (size_t r = 0; r < replicas; ++r) any = any || sent(r);
      if (!any) continue;  // no replica produced a gradient of this dtype
      // A replica this backward did not reach (or that produced nothing of
      // this dtype) adds zeros: the collective keeps one device list per
      // replica count instead of one per subset.
      std::vector<Tensor> srcs;
      std::vector<Event> ready;
      for (size_t r = 0; r < replicas; ++r) {
        const Device dev = step_->devices[r];
        if (sent(r)) {
          srcs.push_back(grads[r * groups + g]);
          ready.push_back(*step_->ready[bucket_][r]);
        } else {
          srcs.push_back(zeros({layout.numels[g]}, TensorOptions(layout.dtypes[g], dev)));
          ready.emplace_back(dev, /*timing=*/false);
          ready.back().record();
        }
      }
      out[g] = step_->engine->reduce(srcs, ready);
      if (!step_->replica_grads.empty()) step_->results[bucket_][g] = srcs;
      for (size_t i = 0; i < bucket.ks.size(); ++i) {
        if (layout.segments[i].group != g) continue;
        bool got = false;
        for (size_t r = 0; r < replicas && !got; ++r) got = sent(r) && step_->got[r][bucket.ks[i]];
        step_->summed[bucket.ks[i]] = got;
      }
    }
    return out;
  }

 private:
  // Note [Gradients summed where they are]: input r * S + s is replica r's
  // slot s (S slots: BucketSplit); every slot of the bucket is summed in
  // place by one grouped all-reduce, and output s is replica 0's sum of slot s.
  TensorList sum_each(TensorList&& grads) {
    const GradBuckets::Bucket& bucket = step_->engine->plan().buckets[bucket_];
    const BucketSplit& split = (*step_->split)[bucket_];
    const FlatLayout& layout = bucket.layout;
    const size_t slots = split.slots(), replicas = step_->devices.size();
    // A replica sends every slot or none (ReplicaBackward::pass_on).
    std::vector<char> sent(replicas, 0);
    for (size_t r = 0; r < replicas; ++r)
      for (size_t s = 0; s < slots; ++s) sent[r] = sent[r] || (r * slots + s < grads.size() && grads[r * slots + s].defined());
    // Which parameters got a sum: those produced by a replica that sent its
    // buffers in this pass (noted by the replica nodes; the handover of their
    // outputs orders those writes before these reads).
    bool any = false;
    for (size_t k : bucket.ks) {
      bool got = false;
      for (size_t r = 0; r < replicas && !got; ++r) got = sent[r] && step_->got[r][k];
      step_->summed[k] = got;
      any = any || got;
    }
    TensorList out(slots);
    if (!any) return out;  // no replica produced one: none, as for a plain module
    std::vector<std::vector<Tensor>> bufs(slots);  // [slot][replica]
    std::vector<Event> ready;
    for (size_t r = 0; r < replicas; ++r) {
      const Device dev = step_->devices[r];
      if (sent[r]) {
        for (size_t s = 0; s < slots; ++s) {
          CHORUS_ASSERT(grads[r * slots + s].defined());
          bufs[s].push_back(std::move(grads[r * slots + s]));
        }
        ready.push_back(*step_->ready[bucket_][r]);
        continue;
      }
      // A replica the backward did not reach for this bucket adds zeros, made
      // on this thread's stream of its device and ordered by an event after them.
      for (size_t s = 0; s < slots; ++s) {
        if (s < split.direct.size()) {
          const FlatLayout::Segment& seg = layout.segments[split.direct[s]];
          bufs[s].push_back(chorus::detail::make_view(
              zeros({numel_of(seg.sizes)}, TensorOptions(layout.dtypes[seg.group], dev)), seg.sizes, seg.strides, 0));
        } else {
          const size_t g = s - split.direct.size();
          bufs[s].push_back(zeros({split.small.numels[g]}, TensorOptions(split.small.dtypes[g], dev)));
        }
      }
      ready.emplace_back(dev, /*timing=*/false);
      ready.back().record();
    }
    if (step_->exchange) {
      // Note [Gradient sums in the update]: each side gets the other's
      // gradients beside its own, as their pending part.
      std::vector<std::vector<Tensor>> parts = step_->engine->exchange_each(bufs, ready);
      for (size_t s = 0; s < slots; ++s)
        for (size_t r = 0; r < replicas; ++r) autograd::set_pending_sum(bufs[s][r], parts[s][r]);
    } else {
      step_->engine->sum_each(bufs, ready);
    }
    for (size_t s = 0; s < slots; ++s) {
      out[s] = bufs[s][0];
      if (!step_->replica_grads.empty()) {
        step_->results[bucket_][s] = std::move(bufs[s]);
        // A large gradient's sum goes on as the output alone (a second handle
        // would make its AccumulateGrad copy it); a flat buffer is viewed.
        if (s < split.direct.size()) step_->results[bucket_][s][0] = Tensor();
      }
    }
    return out;
  }

  std::shared_ptr<GradStep> step_;
  size_t bucket_;
};

// The view of packed parameter i of a bucket in its flat buffer, with the
// same view of the buffer's pending part, if it has one (Note [Gradient sums
// in the update]).
Tensor small_view(const BucketSplit& split, const Tensor& flat, size_t i) {
  Tensor v = split.small.view(flat, split.small_index[i]);
  if (Tensor part = autograd::pending_part(flat); part.defined())
    autograd::set_pending_sum(v, split.small.view(part, split.small_index[i]));
  return v;
}

// Every bucket's result -> one gradient per master parameter, after joining
// the current stream of devices[0] to the collectives (one wait, once the last
// bucket is issued). Input offsets[b] + g is bucket b's result of dtype group g.
class JoinBackward final : public autograd::Node {
 public:
  JoinBackward(std::shared_ptr<GradStep> step, std::vector<size_t> offsets)
      : step_(std::move(step)), offsets_(std::move(offsets)) {}
  std::string name() const override { return "ReducerJoinBackward"; }

  TensorList apply(TensorList&& grads) override {
    step_->engine->join({step_->devices[0]});
    const GradBuckets& buckets = step_->engine->plan();
    if (!step_->replica_grads.empty()) set_replica_grads();
    TensorList out(step_->summed.size());
    for (size_t k = 0; k < out.size(); ++k) {
      if (!step_->summed[k]) continue;  // no replica produced one: none, as for a plain module
      const size_t b = buckets.bucket_of[k], i = buckets.index_in_bucket[k];
      const FlatLayout& layout = buckets.buckets[b].layout;
      if (step_->each) {
        // Note [Gradients summed where they are]: a large gradient's sum
        // itself, which only this handle refers to now; a small one's view of
        // its flat sum.
        const BucketSplit& split = (*step_->split)[b];
        const size_t in = offsets_[b] + split.slot[i];
        if (in >= grads.size() || !grads[in].defined()) continue;
        out[k] = split.is_direct(i) ? std::move(grads[in]) : small_view(split, grads[in], i);
        autograd::mark_owned_view(out[k]);
        continue;
      }
      const size_t in = offsets_[b] + layout.segments[i].group;
      if (in < grads.size() && grads[in].defined()) {
        // Disjoint views of a fresh result that only they refer to once this
        // node returns: each master's AccumulateGrad keeps its view as .grad.
        out[k] = step_->engine->view(k, grads[in]);
        autograd::mark_owned_view(out[k]);
      }
    }
    return out;
  }

 private:
  // Each replica's copy of the sums, as views of its own reduced buckets
  // (Note [Replicated updates] in parallel/data_parallel.h); its device's
  // current stream waits for the collectives first.
  void set_replica_grads() {
    const GradBuckets& buckets = step_->engine->plan();
    for (size_t r = 1; r < step_->devices.size(); ++r) {
      // This thread's current stream of devices[r] is not the caller's
      // (DeviceThreadPool carries only a thread's own device's stream): the
      // join, and any accumulation below, go to the caller's.
      StreamGuard on_callers(step_->caller_streams[r]);
      step_->engine->join({step_->devices[r]});
      for (size_t k = 0; k < step_->summed.size(); ++k) {
        const Tensor& target = step_->replica_grads[r][k];
        if (!target.defined()) continue;
        // A second backward without zero_grad: the master's AccumulateGrad
        // adds to the gradient it has, and the replica does the same.
        const bool accumulate = autograd::unfinished_grad(step_->masters[k]).defined();
        if (!step_->summed[k]) {
          // Nothing new: a gradient kept from an earlier backward stays, as
          // its master's does.
          if (!accumulate) target.set_grad(Tensor());
          continue;
        }
        const size_t b = buckets.bucket_of[k], i = buckets.index_in_bucket[k];
        const FlatLayout& layout = buckets.buckets[b].layout;
        if (step_->each) {
          const BucketSplit& split = (*step_->split)[b];
          const Tensor& sum = step_->results[b][split.slot[i]][r];
          if (split.is_direct(i)) {
            give(target, sum, accumulate);
          } else {
            Tensor g = small_view(split, sum, i);
            autograd::mark_owned_view(g);
            give(target, g, accumulate);
          }
          continue;
        }
        const Tensor& buf = step_->results[b][layout.segments[i].group][r];
        Tensor g = step_->engine->view(k, buf);
        autograd::mark_owned_view(g);
        give(target, g, accumulate);
      }
    }
  }

  // A replica's parameter gets its share of this backward's sum as .grad,
  // or, when its master accumulates (an earlier backward without zero_grad),
  // adds it to the one it has, as the master's AccumulateGrad does and in the
  // same order: the replica stays bit-equal to its master. (A replica's stale
  // gradient whose master was zeroed some other way, Module::zero_grad on the
  // wrapped module, is replaced.)
  static void give(const Tensor& target, const Tensor& g, bool accumulate) {
    Tensor old = autograd::unfinished_grad(target);
    if (!accumulate) {
      target.set_grad(g);
      return;
    }
    if (!old.defined()) {
      // Its master holds an earlier backward's gradient that this replica
      // missed (that forward left it out): it cannot step alike, so it steps
      // not at all and the optimizer copies its master's new value and state
      // (Note [Optimizer replicas]).
      target.set_grad(Tensor());
      return;
    }
    NoGradGuard no_grad;
    autograd::finish_grad(old);
    autograd::finish_grad(g);
    ops::binary_(BinaryOp::Add, old, g, 1.0);
  }

  std::shared_ptr<GradStep> step_;
  std::vector<size_t> offsets_;  // [bucket]: its first input
};

}  // namespace

Reducer::Reducer(std::vector<Tensor> params, std::shared_ptr<CommHook> comm, ReducerOptions options)
    : params_(std::move(params)) {
  CHORUS_CHECK(options.bucket_bytes >= 0, "Reducer: bucket_bytes must be >= 0 (0: one bucket), got ",
               options.bucket_bytes);
  CHORUS_CHECK(options.first_bucket_bytes >= 0, "Reducer: first_bucket_bytes must be >= 0, got ",
               options.first_bucket_bytes);
  CHORUS_CHECK(options.last_bucket_bytes >= 0, "Reducer: last_bucket_bytes must be >= 0, got ",
               options.last_bucket_bytes);
  CHORUS_CHECK(comm != nullptr, "Reducer: no communication hook");
  // Note [One reducer engine]: in one process the autograd engine's
  // dependency counts are the ready counts (Note [Gradient nodes]).
  engine_ = std::make_shared<BucketEngine>(
      std::make_shared<const GradBuckets>(params_, options.bucket_bytes, options.first_bucket_bytes,
                                          std::vector<size_t>{}, options.last_bucket_bytes),
      std::move(comm), BucketReadiness::Order::AsReady);
  const int64_t min_bytes = options.in_place_min_bytes;
  CHORUS_CHECK(min_bytes >= 0, "Reducer: in_place_min_bytes must be >= 0, got ", min_bytes);
  auto split = std::make_shared<std::vector<BucketSplit>>();
  for (const GradBuckets::Bucket& b : engine_->plan().buckets) split->emplace_back(b, params_, min_bytes);
  split_ = std::move(split);
}

std::vector<std::vector<Tensor>> Reducer::record(const std::vector<Device>& devices,
                                                 const std::vector<std::vector<Tensor>>& replica_params,
                                                 const std::vector<std::vector<Tensor>>& replica_grads) const {
  const size_t used = devices.size(), k_count = params_.size();
  CHORUS_ASSERT(replica_params.size() == used);
  CHORUS_ASSERT(replica_grads.empty() || (replica_grads.size() == used && engine_->comm().all_reduces()));
  const GradBuckets& buckets = engine_->plan();
  const size_t n_buckets = buckets.buckets.size();

  auto step = std::make_shared<GradStep>();
  step->engine = engine_;
  step->devices = devices;
  step->got.assign(used, std::vector<char>(k_count, 0));
  step->ready.assign(n_buckets, std::vector<std::optional<Event>>(used));
  step->summed.assign(k_count, 0);
  // Note [Gradients summed where they are]: with more than one replica and a
  // comm that sums each gradient in place (one value per step: a capture and
  // its replays agree).
  step->each = engine_->sums_each(used);
  if (step->each) step->split = split_;
  step->exchange = step->each && engine_->exchanges(devices);
  // What flows per replica and bucket: one flat buffer per dtype, or the
  // large gradients as they are and a flat buffer per dtype of the rest.
  auto slots = [&](size_t b) { return step->each ? (*split_)[b].slots() : buckets.buckets[b].layout.groups(); };
  // The device, dtype and shape of what flows in slot j of bucket b.
  auto slot_meta = [&](size_t b, size_t j, const Device& dev) -> autograd::InputMeta {
    const FlatLayout& layout = buckets.buckets[b].layout;
    if (!step->each) return {dev, layout.dtypes[j], {layout.numels[j]}};
    const BucketSplit& split = (*split_)[b];
    if (j < split.direct.size()) {
      const size_t k = buckets.buckets[b].ks[split.direct[j]];
      return {dev, params_[k].dtype(), params_[k].sizes()};
    }
    const size_t g = j - split.direct.size();
    return {dev, split.small.dtypes[g], {split.small.numels[g]}};
  };
  if (!replica_grads.empty()) {
    step->replica_grads = replica_grads;
    step->masters = params_;
    step->results.resize(buckets.buckets.size());
    for (size_t b = 0; b < buckets.buckets.size(); ++b) step->results[b].resize(slots(b));
    for (const Device& d : devices) step->caller_streams.push_back(Stream::current(d));
  }

  std::vector<size_t> offsets;
  size_t join_inputs = 0;
  for (size_t b = 0; b < n_buckets; ++b) {
    offsets.push_back(join_inputs);
    join_inputs += slots(b);
  }
  auto join = std::make_shared<JoinBackward>(step, offsets);
  join->seq = autograd::next_urgent_sequence_nr();
  join->device = devices[0];
  join->num_outputs = static_cast<uint32_t>(join_inputs);
  for (const Tensor& m : params_) {
    join->next.push_back(autograd::gradient_edge(m));
    join->input_meta.push_back({m.device(), m.dtype(), m.sizes()});
  }
  std::vector<std::shared_ptr<BucketBackward>> bucket_nodes;
  for (size_t b = 0; b < n_buckets; ++b) {
    auto node = std::make_shared<BucketBackward>(step, b);
    node->seq = autograd::next_urgent_sequence_nr();
    node->device = devices[0];
    const size_t n = slots(b);
    node->num_outputs = static_cast<uint32_t>(used * n);
    for (size_t j = 0; j < n; ++j) {
      node->next.push_back(autograd::Edge{join, static_cast<uint32_t>(offsets[b] + j)});
      node->input_meta.push_back(slot_meta(b, j, devices[0]));
    }
    bucket_nodes.push_back(std::move(node));
  }
  std::vector<std::vector<Tensor>> out(used, std::vector<Tensor>(k_count));
  for (size_t r = 0; r < used; ++r) {
    std::vector<std::shared_ptr<ReplicaBackward>> nodes;
    for (size_t b = 0; b < n_buckets; ++b) {
      auto node = std::make_shared<ReplicaBackward>(step, r, b);
      node->seq = autograd::next_urgent_sequence_nr();
      node->device = devices[r];  // the engine runs it on this device's thread
      node->num_outputs = static_cast<uint32_t>(buckets.buckets[b].ks.size());
      const size_t n = slots(b);
      for (size_t j = 0; j < n; ++j) {
        node->next.push_back(autograd::Edge{bucket_nodes[b], static_cast<uint32_t>(r * n + j)});
        node->input_meta.push_back(slot_meta(b, j, devices[r]));
      }
      nodes.push_back(std::move(node));
    }
    // Fresh tensors each forward (a tensor has one grad_fn).
    for (size_t k = 0; k < k_count; ++k) {
      Tensor v = replica_params[r][k].detach();
      v.set_grad_fn(nodes[buckets.bucket_of[k]], static_cast<uint32_t>(buckets.index_in_bucket[k]));
      // Autocast keeps the parameter's own 16-bit copy, which the optimizer
      // writes (Note [Autocast weight copies]), instead of casting afresh.
      v.autograd_meta()->stands_for = replica_params[r][k].impl_ptr();
      out[r][k] = std::move(v);
    }
  }
  return out;
}

}  // namespace chorus::dist
