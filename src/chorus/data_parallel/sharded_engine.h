// ShardedDataParallel's engine (sharded.h), private to data_parallel/: the state of
// the buckets and pieces, the gathers (Note [Sharded gathers]), the gradient
// reduce-scatters (Note [Sharded gradients]) and the backward observer that
// drives them. sharded.cpp builds it; sharded_state.cpp reads and loads the
// state it holds.
#pragma once

#include "chorus/data_parallel/sharded.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <unordered_map>

#include "chorus/autograd/backward_observer.h"
#include "chorus/autograd/grad_mode.h"
#include "chorus/autograd/node.h"
#include "chorus/autograd/side_work.h"
#include "chorus/core/error.h"
#include "chorus/core/graph_capture.h"
#include "chorus/core/warn.h"
#include "chorus/data_parallel/bucket_engine.h"
#include "chorus/data_parallel/replica_sync.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/elementwise.h"
#include "chorus/ops/factory.h"
#include "chorus/ops/profile.h"

namespace chorus::dist {

struct ShardedDataParallel::Impl final : autograd::BackwardObserver {
  ProcessGroupPtr group;
  ShardOptions options;
  int world = 1, rank = 0;
  std::vector<std::string> names;  // [k] trainable parameters, module order
  std::vector<Tensor> params;      // [k]
  GradBuckets plan;

  // One dtype group of one bucket (Note [Sharded gradients]).
  struct Flat {
    DType dtype = kFloat32;         // the gathered parameters' (and their gradients')
    DType master_dtype = kFloat32;  // the master shard's (and its gradient's)
    int64_t padded = 0, per = 0;    // padded = per * world
    Tensor full;        // [padded] the gathered weights; the parameters view it
    Tensor master;      // [per] this rank's shard (stages 1-2 in one dtype: a view of full)
    Tensor grad_full;   // [padded] stage 1: persistent; 2-3: during the launch only
    // [per] where this step's reduce-scatter writes, from the launch to
    // finish(): stage 1 grad_full's own segment (in place); stages 2-3 (or a
    // cast to reduce_dtype) a tensor of its own. Note [Sharded gradient shards].
    Tensor rs_out;
    WorkPtr gather_work, rs_work;
    Tensor gather_src;  // kept until the gather is done
  };
  struct Bucket {
    std::vector<Flat> flats;
    bool gathered = false;  // full holds this rank's view of the weights
    bool stale = true;      // a shard changed since the last gather
    bool held = false;      // gather_parameters(): kept until the next training forward
    int unit = -1;          // stage 3: its unit (-1: the root unit)
    // Stage 3: its wrapper ran in the first step (Note [Sharded units]);
    // `sharded`: every rank's did, so it is gathered and freed on its own.
    bool visited = false, sharded = false;
  };
  std::vector<Bucket> buckets;
  int64_t peak_full_grads = 0;  // held_bytes().peak_full_grads
  std::vector<std::string> unit_names;  // [bucket]
  std::vector<int> unit_order;          // stage 3: buckets in the first forward's order
  bool order_known = false;

  std::vector<DType> master_dtypes, full_dtypes;  // [k] before wrapping; while gathered
  std::vector<Tensor> shard_params;  // the optimizer's pieces
  std::vector<Piece> pieces;
  std::vector<std::vector<size_t>> pieces_of;  // [k]
  std::vector<std::pair<size_t, size_t>> piece_flat;  // [i] bucket, group
  std::vector<int64_t> piece_offset;  // [i] within its shard

  std::weak_ptr<Impl> self;  // for the actions run after each CUDA-graph replay
  std::mutex mu;
  bool no_sync = false, arm_next = false, in_backward = false;
  // A backward through the module runs (synced or not): a unit's forward now
  // is its recomputation (--recompute), just before its own backward.
  bool backward_running = false;
  PassStack passes;        // Note [Nested backward passes]
  size_t armed_depth = 0;  // the depth of the pass that reduces
  // Note [One reducer engine] (bucket_engine.h): the reducer's ready counts
  // and launch order; every rank launches its buckets in index order (the
  // plan is fixed: no ready order to record).
  BucketReadiness readiness = [] {
    BucketReadiness r(BucketReadiness::Order::InOrder);
    r.stop_recording();
    return r;
  }();
  std::vector<char> unused;
  std::vector<int64_t> used;  // [k] this rank's flags
  Tensor all_used;            // [k] ones on the group's device: the flags of a step that used everything
  std::vector<std::string> unused_names;
  std::unique_ptr<FlatSet> buffers;

  // Stages 1-2 with units (Note [Gathers beside the forward]): [unit] the
  // buckets its forward waits for; [bucket] whether it holds a parameter of
  // no unit (waited for by the module's forward); the order of issue.
  std::vector<std::vector<size_t>> unit_gathers;
  std::vector<char> root_gather;
  std::vector<size_t> gather_order;
  // Whose wrapper ran in the first synced step, and whether that step is
  // over: until then the forward waits for every gather at its start.
  std::vector<char> unit_ran;
  bool unit_waits_decided = false;

  bool stage3() const { return options.stage == 3; }
  bool gathers_beside_forward() const { return !stage3() && !gather_order.empty() && options.prefetch; }
  // Stage 3: gathered by the module's forward itself (not by a unit wrapper).
  bool gathered_whole_step(size_t b) const { return buckets[b].unit < 0 || !buckets[b].sharded; }
  // Stage 3: after the first synced backward, or from construction for the
  // units the caller named (Note [Sharded units]).
  bool units_decided = false;

  // ---- gathers (Note [Sharded gathers]) ----------------------------------------

  // Issues bucket b's all-gather (not waiting for it); once until it is
  // waited for (gather_src marks it issued, on one rank too).
  void issue_gather(size_t b) {
    Bucket& bk = buckets[b];
    if (bk.gathered) return;
    for (Flat& f : bk.flats) {
      if (f.gather_src.defined()) continue;
      f.full.storage()->reallocate();
      if (gathers_in_place()) {
        // Note [Gathers in place]: this rank's own segment of `full` is the
        // input -- the master itself in one dtype, else its cast, made there.
        Tensor own = f.full.narrow(0, static_cast<int64_t>(rank) * f.per, f.per);
        if (f.master_dtype != f.dtype) ops::copy_(own, f.master);
        f.gather_src = own;
        if (world > 1) f.gather_work = group->all_gather(own, f.full);
        continue;
      }
      // A copy of the shard: Gloo's all-gather may not read its output.
      f.gather_src = f.master_dtype == f.dtype ? ops::clone(f.master) : ops::to_dtype(f.master, f.dtype);
      f.gather_work = world > 1 ? group->all_gather(f.gather_src, f.full) : WorkPtr();
      if (world == 1) ops::copy_(f.full, f.gather_src);
    }
  }

  // Note [Gathers in place]: at stages 1-2 `full` persists and holds this
  // rank's segment at rank * per, which is where an in-place all-gather
  // (NCCL's: the input at output + rank * count) reads it, and where stage
  // 1-2's master already lives when it shares full's dtype. So NCCL (and one
  // rank) gathers from there: no copy of the shard, and under param_dtype the
  // cast is written straight into it, not into a tensor of its own that
  // lived until the gather was waited for -- a shard's worth of memory per
  // bucket in flight, all of them at once when the gathers go beside the
  // forward (gpt2-xl on one H200: 3 GiB more at the peak). Gloo reads a
  // copy; stage 3 frees `full` between gathers, so its shard lives apart.
  bool gathers_in_place() const { return !stage3() && (world == 1 || group->backend() == "nccl"); }

  void wait_gather(size_t b) {
    Bucket& bk = buckets[b];
    if (bk.gathered) return;
    issue_gather(b);
    {
      ops::TraceScope trace("wait_gather");
      for (Flat& f : bk.flats) {
        if (f.gather_work) f.gather_work->wait();
        f.gather_work.reset();
        f.gather_src = Tensor();
      }
    }
    bk.gathered = true;
    if (bk.stale) {
      // New values: autocast's kept copies and DataParallel's replicas re-sync.
      for (size_t k : plan.buckets[b].ks) params[k].bump_version();
      bk.stale = false;
    }
  }

  void release(size_t b) {
    Bucket& bk = buckets[b];
    if (!stage3() || !bk.gathered || bk.held) return;
    for (Flat& f : bk.flats) f.full.storage()->release();
    bk.gathered = false;
  }

  // Stage 3: the unit gathered after (forward) or before (backward) b.
  void prefetch_after(size_t b, int step) {
    if (!options.prefetch || !order_known) return;
    auto it = std::find(unit_order.begin(), unit_order.end(), static_cast<int>(b));
    if (it == unit_order.end()) return;
    const ptrdiff_t at = (it - unit_order.begin()) + step;
    if (at < 0 || at >= static_cast<ptrdiff_t>(unit_order.size())) return;
    issue_gather(static_cast<size_t>(unit_order[at]));
  }

  // Before the units are decided everything is gathered and no wrapper
  // communicates: a unit run on some ranks only must not start a collective.
  void before_unit_forward(size_t b) {
    std::lock_guard<std::mutex> lk(mu);
    if (!stage3()) {  // b is the unit's index: Note [Gathers beside the forward]
      unit_ran[b] = 1;
      for (size_t g : unit_gathers[b]) wait_gather(g);
      return;
    }
    if (!units_decided) {
      buckets[b].visited = true;
      if (std::find(unit_order.begin(), unit_order.end(), static_cast<int>(b)) == unit_order.end())
        unit_order.push_back(static_cast<int>(b));
      return;
    }
    // Trusted units (ShardOptions::units) learn their order in the first step.
    if (!order_known && std::find(unit_order.begin(), unit_order.end(), static_cast<int>(b)) == unit_order.end())
      unit_order.push_back(static_cast<int>(b));
    if (gathered_whole_step(b)) return;
    wait_gather(b);
    // A recomputation inside the backward: the backward's pre-hook prefetches
    // (the unit before this one); the next unit's backward is already done.
    if (!backward_running) prefetch_after(b, +1);
  }

  void after_unit_forward(size_t b) {
    std::lock_guard<std::mutex> lk(mu);
    if (!stage3()) return;
    // A recomputed unit keeps its weights for its backward, which follows.
    if (units_decided && !gathered_whole_step(b) && options.reshard_after_forward && !backward_running) release(b);
  }

  void before_unit_backward(size_t b) {
    std::lock_guard<std::mutex> lk(mu);
    if (!stage3() || !units_decided || gathered_whole_step(b)) return;
    wait_gather(b);
    prefetch_after(b, -1);
  }

  // Stages 1-2, after the first synced backward (Note [Gathers beside the
  // forward]): a unit whose wrapper did not run -- skipped that step, or
  // called by its parent past the wrapper -- has its buckets waited for at
  // the forward's start from now on. Only waits change, each rank on its
  // own: the gathers' order, the same on every rank, stays.
  void decide_unit_waits() {
    for (size_t u = 0; u < unit_gathers.size(); ++u) {
      if (unit_ran[u]) continue;
      for (size_t g : unit_gathers[u]) root_gather[g] = 1;
      unit_gathers[u].clear();
    }
    unit_waits_decided = true;
  }

  // After the first synced backward: the units every rank's forward ran
  // through their wrappers are sharded from now on (one all-reduce).
  void decide_units() {
    const int64_t n = static_cast<int64_t>(buckets.size());
    std::vector<int64_t> seen(buckets.size());
    for (size_t b = 0; b < buckets.size(); ++b) seen[b] = buckets[b].visited ? 1 : 0;
    if (world > 1) {
      Tensor t = ops::to_device(from_vector(seen, {n}), group->device());
      group->all_reduce(t, ReduceOp::Min)->wait();
      seen = t.to_vector<int64_t>();
    }
    std::string missed;
    for (size_t b = 0; b < buckets.size(); ++b) {
      buckets[b].sharded = buckets[b].unit >= 0 && seen[b] != 0;
      if (buckets[b].unit >= 0 && !buckets[b].sharded) missed += (missed.empty() ? "" : ", ") + unit_names[b];
    }
    std::vector<int> order;
    for (int b : unit_order)
      if (buckets[b].sharded) order.push_back(b);
    unit_order = order;
    order_known = true;
    units_decided = true;
    if (!missed.empty())
      warn("ShardedDataParallel: units " + missed + " did not run through their wrappers on every rank in the "
           "first step (a unit used on some steps or ranks only, or called through a parent's own pointer rather "
           "than its children), so they are gathered for the whole step with the root unit: their weights are "
           "sharded only between steps");
  }

  // ---- gradients (Note [Sharded gradients]) ------------------------------------

  // Caller holds mu. Bucket b's gradients into its full buffer, reduce-scattered.
  void launch(size_t b) {
    const GradBuckets::Bucket& pb = plan.buckets[b];
    Bucket& bk = buckets[b];
    // The previous bucket's reduce-scatter is ordered before what follows: its
    // full-size buffer can go (stages 2-3).
    if (b > 0 && options.stage > 1) {
      for (Flat& f : buckets[b - 1].flats)
        if (f.rs_work) {
          f.rs_work->wait();
          f.rs_work.reset();
          f.grad_full = Tensor();
        }
    }
    // Stage 1: pieces still holding the last step's gradient (accumulation
    // across synced steps) may view this buffer's own segment, which the
    // copies below overwrite: they keep a copy (Note [Sharded gradient shards]).
    if (options.stage == 1)
      for (size_t k : pb.ks)
        for (size_t i : pieces_of[k]) {
          const Tensor old = shard_params[i].grad();
          const Tensor& full = bk.flats[piece_flat[i].second].grad_full;
          if (old.defined() && full.defined() && old.storage() == full.storage())
            shard_params[i].set_grad(ops::clone(old));
        }
    for (size_t g = 0; g < bk.flats.size(); ++g) {
      Flat& f = bk.flats[g];
      if (!f.grad_full.defined()) f.grad_full = zeros({f.padded}, TensorOptions(f.dtype, pb.device));
      else if (options.stage > 1) ops::fill_(f.grad_full, 0.0);
      note_full_grads();
      TensorList srcs, dsts;
      for (size_t i = 0; i < pb.ks.size(); ++i) {
        if (pb.layout.segments[i].group != g) continue;
        const size_t k = pb.ks[i];
        Tensor grad = params[k].grad();
        Tensor dst = pb.layout.view(f.grad_full, i);
        if (grad.defined()) {
          autograd::join_beside_for(grad);
          srcs.push_back(grad);
          dsts.push_back(dst);
        } else if (options.stage == 1) {
          dsts.push_back(dst);  // stage 1's persistent buffer holds the last step's: zero it
          srcs.push_back(Tensor());
        }
      }
      TensorList s2, d2;
      for (size_t i = 0; i < srcs.size(); ++i) {
        if (srcs[i].defined()) {
          s2.push_back(srcs[i]);
          d2.push_back(dsts[i]);
        } else {
          ops::fill_(dsts[i], 0.0);
        }
      }
      if (!s2.empty()) ops::copy_multi(s2, d2);
      const DType travel = options.reduce_dtype.value_or(f.dtype);
      const ReduceOp op = options.average ? ReduceOp::Avg : ReduceOp::Sum;
      // This rank's segment of the full buffer: stage 1's reduce-scatter
      // output, in place (both backends accept it: process_group.h). Stages
      // 2-3 reduce into a shard of their own, made now in the masters' dtype
      // (Note [Sharded gradient shards]).
      Tensor own = f.grad_full.narrow(0, static_cast<int64_t>(rank) * f.per, f.per);
      f.rs_work.reset();
      if (world == 1) {
        f.rs_out = options.stage == 1        ? own
                   : f.master_dtype == f.dtype ? ops::clone(own)
                                               : ops::to_dtype(own, f.master_dtype);
      } else if (travel == f.dtype && (options.stage == 1 || travel == f.master_dtype)) {
        f.rs_out = options.stage == 1 ? own : empty({f.per}, TensorOptions(f.master_dtype, pb.device));
        f.rs_work = group->reduce_scatter(f.grad_full, f.rs_out, op);
      } else {
        // In another dtype than the buffer's (reduce_dtype) or the masters'
        // (param_dtype): reduced into a temporary, waited for (the current
        // stream ordered after it), and at stages 2-3 cast now, as the
        // gradients arrive; stage 1 casts in finish().
        Tensor in = travel == f.dtype ? f.grad_full : ops::to_dtype(f.grad_full, travel);
        Tensor out = empty({f.per}, TensorOptions(travel, pb.device));
        group->reduce_scatter(in, out, op)->wait();
        f.rs_out = options.stage == 1 || travel == f.master_dtype ? out : ops::to_dtype(out, f.master_dtype);
      }
      // Without a reduce-scatter in flight (one rank; or one waited for
      // above, the current stream ordered after it) the full-size buffer
      // can go now, in stream order: the next launch frees only buffers
      // whose reduce-scatter is still in flight, so stages 2-3 would keep
      // these to the end of the backward (every 16-bit one under
      // param_dtype).
      if (options.stage > 1 && !f.rs_work) f.grad_full = Tensor();
    }
    // The module's gradients are in the bucket now: drop them (stages 2-3
    // keep gradients as shards only; every stage starts the next backward
    // from none, as after zero_grad).
    for (size_t k : pb.ks) params[k].zero_grad();
    if (stage3() && units_decided && !gathered_whole_step(b)) release(b);
  }

  // Stage 1, after the reduce-scatter: a [per] tensor of the masters' dtype
  // inside f's full gradient buffer, over other ranks' segments (spent once
  // the reduce-scatter is done) and not this rank's own, which it is cast
  // from; undefined where it does not fit there (Note [Sharded gradient
  // shards]: bfloat16 to float32 on fewer than 4 ranks). Every segment starts
  // 128-byte aligned (GradBuckets::padded_numel), so the view is as aligned
  // as a fresh tensor. The next launch writes every parameter's elements of
  // the buffer again; the padding between them then holds these bytes, which
  // only the reduce-scatter reads (nothing reads the shards' padding).
  Tensor shard_in_full(const Flat& f) const {
    const int64_t seg = f.per * static_cast<int64_t>(dtype_size(f.dtype));
    const int64_t need = f.per * static_cast<int64_t>(dtype_size(f.master_dtype));
    const int64_t own = static_cast<int64_t>(rank) * seg, end = static_cast<int64_t>(world) * seg;
    int64_t at = -1;  // bytes into the buffer
    if (need <= own)
      at = 0;
    else if (own + seg + need <= end)
      at = own + seg;
    const int64_t msize = static_cast<int64_t>(dtype_size(f.master_dtype));
    const int64_t base = f.grad_full.storage_offset() * static_cast<int64_t>(dtype_size(f.dtype));
    if (at < 0 || (base + at) % msize != 0) return Tensor();
    Tensor v = chorus::detail::make_view(f.grad_full, {f.per}, {1}, 0);
    v.impl()->dtype = f.master_dtype;  // the same bytes, read as the masters' dtype
    v.impl()->offset = (base + at) / msize;
    return v;
  }

  // Caller holds mu. The full-size gradient bytes held now, into the peak
  // (held_bytes()).
  void note_full_grads() {
    int64_t now = 0;
    for (const Bucket& bk : buckets)
      for (const Flat& f : bk.flats)
        if (f.grad_full.defined()) now += static_cast<int64_t>(f.grad_full.nbytes());
    peak_full_grads = std::max(peak_full_grads, now);
  }

  // Caller holds mu.
  void mark_ready(size_t k) {
    readiness.mark_ready(k, [this](size_t b) { launch(b); });
  }

  void on_grad_ready(size_t k) {
    std::lock_guard<std::mutex> lk(mu);
    if (!in_backward) return;  // not armed (no_sync): a plain accumulation
    CHORUS_CHECK(!readiness.is_ready(k), "ShardedDataParallel: the gradient of '", names[k],
                 "' became ready twice in one backward");
    mark_ready(k);
  }

  // After the last bucket: every reduce-scatter done, the gradient shards in
  // the masters' dtype, the replicas' average (hybrid), the used-flags, and
  // the pieces' gradients (added to those they still hold: accumulation).
  void finish() {
    const ReduceOp op = options.average ? ReduceOp::Avg : ReduceOp::Sum;
    std::vector<Tensor> shards;  // [flat, bucket order]: held by the pieces' gradients only, from here
    for (Bucket& bk : buckets)
      for (Flat& f : bk.flats) {
        if (f.rs_work) f.rs_work->wait();
        f.rs_work.reset();
        // Note [Sharded gradient shards]: in the masters' dtype, made now.
        Tensor shard = f.rs_out;
        if (shard.dtype() != f.master_dtype) {
          shard = options.stage == 1 ? shard_in_full(f) : Tensor();
          if (shard.defined())
            ops::copy_(shard, f.rs_out);
          else
            shard = ops::to_dtype(f.rs_out, f.master_dtype);
        }
        if (options.replicate_group && options.replicate_group->size() > 1)
          options.replicate_group->all_reduce(shard, op)->wait();
        shards.push_back(shard);
        f.rs_out = Tensor();
        if (options.stage > 1) f.grad_full = Tensor();
      }
    std::vector<size_t> first_flat(buckets.size(), 0);
    for (size_t b = 1; b < buckets.size(); ++b) first_flat[b] = first_flat[b - 1] + buckets[b - 1].flats.size();
    // Used somewhere? (Note [DDP unused parameters]): the flags travel every
    // step (every rank must issue the same collectives), but only a rank
    // that left a parameter unused reads them on the host; the usual step
    // builds them on the device and waits for nothing.
    const int64_t n = static_cast<int64_t>(params.size());
    const bool everything = std::all_of(used.begin(), used.end(), [](int64_t u) { return u != 0; });
    std::vector<int64_t> counts = used;
    if (world > 1 || (options.replicate_group && options.replicate_group->size() > 1)) {
      if (everything && !all_used.defined()) all_used = ones({n}, TensorOptions(kInt64, group->device()));
      Tensor flags = everything ? ops::clone(all_used) : ops::to_device(from_vector(used, {n}), group->device());
      group->all_reduce(flags, ReduceOp::Sum)->wait();
      if (options.replicate_group && options.replicate_group->size() > 1)
        options.replicate_group->all_reduce(flags, ReduceOp::Sum)->wait();
      if (!everything) counts = flags.to_vector<int64_t>();
    }
    unused_names.clear();
    for (size_t k = 0; k < params.size(); ++k) {
      if (counts[k] == 0) unused_names.push_back(names[k]);
      for (size_t i : pieces_of[k]) {
        const auto [b, g] = piece_flat[i];
        if (counts[k] == 0) {
          shard_params[i].zero_grad();
          continue;
        }
        Tensor grad = shards[first_flat[b] + g].narrow(0, piece_offset[i], pieces[i].end - pieces[i].begin);
        if (const Tensor old = shard_params[i].grad(); old.defined()) ops::binary_(BinaryOp::Add, grad, old);
        shard_params[i].set_grad(grad);
      }
    }
    if (stage3() && !units_decided) decide_units();
    if (!stage3() && !unit_gathers.empty() && !unit_waits_decided) decide_unit_waits();
    order_known = true;
    // The optimizer steps next: the shards change, the next forward gathers.
    // Under a CUDA graph this runs after every replay too (Note [Sharded
    // steps in a CUDA graph]): an evaluation between replays gathers afresh.
    on_each_replay([weak = self] {
      if (auto st = weak.lock()) st->mark_stepped();
    });
  }

  // The host state after a synced step (the caller holds mu, or a replay
  // has just ended and nothing else runs).
  void mark_stepped() {
    for (size_t b = 0; b < buckets.size(); ++b) {
      buckets[b].stale = true;
      buckets[b].held = false;
      if (stage3())
        release(b);
      else
        buckets[b].gathered = false;  // the storage stays; its other ranks' parts are old
    }
  }

  // ---- the backward observer ---------------------------------------------------

  void begin(const std::unordered_set<const TensorImpl*>& leaves) override {
    std::lock_guard<std::mutex> lk(mu);
    if (!passes.push(leaves, params)) return;
    backward_running = true;
    if (!arm_next) return;
    arm_next = false;
    in_backward = true;
    armed_depth = passes.depth();
    const size_t n = params.size();
    readiness.arm(plan);
    unused.assign(n, 0);
    const std::vector<size_t> unreached = unreached_params(leaves, params, used);
    for (size_t k : unreached) unused[k] = 1;
    for (size_t k : unreached) mark_ready(k);
  }

  void end(bool ok) override {
    std::lock_guard<std::mutex> lk(mu);
    // Note [Nested backward passes]: only the armed pass's end finishes the step.
    const PassStack::Ended e = passes.pop();
    if (!e.ours) return;
    backward_running = passes.any_ours();
    if (!in_backward || e.depth != armed_depth) return;
    in_backward = false;
    if (!ok) {
      for (Bucket& bk : buckets)
        for (Flat& f : bk.flats) {
          try {
            if (f.rs_work) f.rs_work->wait();
          } catch (...) {
          }
          f.rs_work.reset();
          f.rs_out = Tensor();
        }
      return;
    }
    ops::TraceScope wait("wait_gradients");
    // Reached but given no gradient: ready now (their buckets launch in turn).
    const std::vector<size_t> late = readiness.not_ready();
    for (size_t k : late) {
      unused[k] = 1;
      used[k] = params[k].grad().defined() ? 1 : 0;
    }
    for (size_t k : late) mark_ready(k);
    CHORUS_ASSERT(readiness.all_launched());
    finish();
  }
};

}  // namespace chorus::dist
