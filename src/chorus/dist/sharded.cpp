#include "chorus/dist/sharded.h"

#include <algorithm>
#include <atomic>
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
#include "chorus/dist/replica_sync.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/elementwise.h"
#include "chorus/ops/factory.h"
#include "chorus/ops/profile.h"
#include "chorus/ops/global_norm.h"

namespace chorus::dist {

namespace {

std::atomic<int> next_sharded_instance{0};

// Note [Sharded units] (sharded.h): the children of a module whose children
// with parameters are all of one type (a GPT's blocks, a stack of layers),
// found from the top.
void find_shard_units(const nn::ModulePtr& m, std::vector<nn::ModulePtr>* out) {
  std::vector<nn::ModulePtr> with;
  for (const auto& [n, c] : m->named_children())
    if (!c->parameters().empty()) with.push_back(c);
  const bool repeated = with.size() >= 2 && std::all_of(with.begin(), with.end(), [&](const nn::ModulePtr& c) {
                          return c->type_name() == with[0]->type_name();
                        });
  for (const nn::ModulePtr& c : with) {
    if (repeated)
      out->push_back(c);
    else
      find_shard_units(c, out);
  }
}

}  // namespace

// ---- the engine ------------------------------------------------------------------

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
    Tensor grad_shard;  // [per]
    Tensor rs_out;      // where the running reduce-scatter writes (grad_shard or a temporary)
    WorkPtr gather_work, rs_work;
    Tensor gather_src;  // kept until the gather is done
  };
  struct Bucket {
    std::vector<Flat> flats;
    bool gathered = false;  // full holds this rank's view of the weights
    bool stale = true;      // a shard changed since the last gather
    bool accumulate = false;  // the running launch adds to grad_shard
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
  std::vector<char> ready, unused;
  std::vector<size_t> pending;  // [bucket]
  size_t next_launch = 0;
  std::vector<int64_t> used;  // [k] this rank's flags
  Tensor all_used;            // [k] ones on the group's device: the flags of a step that used everything
  std::vector<std::string> unused_names;
  std::unique_ptr<FlatSet> buffers;

  bool stage3() const { return options.stage == 3; }
  // Stage 3: gathered by the module's forward itself (not by a unit wrapper).
  bool gathered_whole_step(size_t b) const { return buckets[b].unit < 0 || !buckets[b].sharded; }
  // Stage 3: after the first synced backward, or from construction for the
  // units the caller named (Note [Sharded units]).
  bool units_decided = false;

  // ---- gathers (Note [Sharded gathers]) ----------------------------------------

  // Issues bucket b's all-gather (not waiting for it).
  void issue_gather(size_t b) {
    Bucket& bk = buckets[b];
    if (bk.gathered) return;
    for (Flat& f : bk.flats) {
      if (f.gather_work) continue;
      f.full.storage()->reallocate();
      // A copy of the shard: the all-gather's input must not alias its output
      // on every backend (stages 1-2 keep the master inside `full`).
      f.gather_src = f.master_dtype == f.dtype ? ops::clone(f.master) : ops::to_dtype(f.master, f.dtype);
      f.gather_work = world > 1 ? group->all_gather(f.gather_src, f.full) : WorkPtr();
      if (world == 1) ops::copy_(f.full, f.gather_src);
    }
  }

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
    // A recomputed unit keeps its weights for its backward, which follows.
    if (units_decided && !gathered_whole_step(b) && options.reshard_after_forward && !backward_running) release(b);
  }

  void before_unit_backward(size_t b) {
    std::lock_guard<std::mutex> lk(mu);
    if (!units_decided || gathered_whole_step(b)) return;
    wait_gather(b);
    prefetch_after(b, -1);
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
    bk.accumulate = false;
    for (size_t k : pb.ks)
      for (size_t i : pieces_of[k])
        if (shard_params[i].grad().defined()) bk.accumulate = true;
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
      f.rs_out = bk.accumulate ? empty({f.per}, TensorOptions(f.master_dtype, pb.device)) : f.grad_shard;
      const DType travel = options.reduce_dtype.value_or(f.dtype);
      const ReduceOp op = options.average ? ReduceOp::Avg : ReduceOp::Sum;
      if (world == 1) {
        ops::copy_(f.rs_out, f.grad_full.narrow(0, 0, f.per));
        f.rs_work.reset();
      } else if (travel != f.dtype || travel != f.master_dtype) {
        Tensor in = travel == f.dtype ? f.grad_full : ops::to_dtype(f.grad_full, travel);
        Tensor out = empty({f.per}, TensorOptions(travel, pb.device));
        group->reduce_scatter(in, out, op)->wait();
        ops::copy_(f.rs_out, out);  // back in the masters' dtype
        f.rs_work.reset();
      } else {
        f.rs_work = group->reduce_scatter(f.grad_full, f.rs_out, op);
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
    ready[k] = 1;
    --pending[plan.bucket_of[k]];
    while (next_launch < plan.buckets.size() && pending[next_launch] == 0) launch(next_launch++);
  }

  void on_grad_ready(size_t k) {
    std::lock_guard<std::mutex> lk(mu);
    if (!in_backward) return;  // not armed (no_sync): a plain accumulation
    CHORUS_CHECK(!ready[k], "ShardedDataParallel: the gradient of '", names[k],
                 "' became ready twice in one backward");
    mark_ready(k);
  }

  // After the last bucket: every reduce-scatter done, the replicas' average
  // (hybrid), accumulation, the used-flags, and the pieces' gradients.
  void finish() {
    const ReduceOp op = options.average ? ReduceOp::Avg : ReduceOp::Sum;
    for (Bucket& bk : buckets)
      for (Flat& f : bk.flats) {
        if (f.rs_work) f.rs_work->wait();
        f.rs_work.reset();
        if (options.replicate_group && options.replicate_group->size() > 1)
          options.replicate_group->all_reduce(f.rs_out, op)->wait();
        if (bk.accumulate) ops::binary_(BinaryOp::Add, f.grad_shard, f.rs_out);
        f.rs_out = Tensor();
        if (options.stage > 1) f.grad_full = Tensor();
      }
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
        const Flat& f = buckets[b].flats[g];
        if (counts[k] == 0)
          shard_params[i].zero_grad();
        else
          shard_params[i].set_grad(f.grad_shard.narrow(0, piece_offset[i], pieces[i].end - pieces[i].begin));
      }
    }
    if (stage3() && !units_decided) decide_units();
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
    bool ours = false;
    for (const Tensor& p : params)
      if (leaves.count(p.impl())) {
        ours = true;
        break;
      }
    passes.push(ours);
    if (!ours) return;
    backward_running = true;
    if (!arm_next) return;
    arm_next = false;
    in_backward = true;
    armed_depth = passes.depth();
    const size_t n = params.size();
    ready.assign(n, 0);
    unused.assign(n, 0);
    used.assign(n, 0);
    pending.assign(plan.buckets.size(), 0);
    next_launch = 0;
    for (size_t k = 0; k < n; ++k) ++pending[plan.bucket_of[k]];
    std::vector<size_t> unreached;
    for (size_t k = 0; k < n; ++k) {
      const bool reached = leaves.count(params[k].impl()) > 0;
      used[k] = reached || params[k].grad().defined();
      if (!reached) unreached.push_back(k);
    }
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
        }
      return;
    }
    ops::TraceScope wait("wait_gradients");
    // Reached but given no gradient: ready now (their buckets launch in turn).
    std::vector<size_t> late;
    for (size_t k = 0; k < params.size(); ++k)
      if (!ready[k]) late.push_back(k);
    for (size_t k : late) {
      unused[k] = 1;
      used[k] = params[k].grad().defined() ? 1 : 0;
    }
    for (size_t k : late) mark_ready(k);
    CHORUS_ASSERT(next_launch == plan.buckets.size());
    finish();
  }
};

// ---- stage 3's unit wrapper ---------------------------------------------------------

// Note [Sharded units]: stands in its parent for the unit module.
class ShardedDataParallel::Unit final : public nn::Module {
 public:
  Unit(nn::ModulePtr inner, std::weak_ptr<Impl> engine, size_t bucket)
      : nn::Module(inner->type_name()), inner_(std::move(inner)), engine_(std::move(engine)), bucket_(bucket) {
    register_child("", inner_);  // no name: the parameters keep theirs
  }
  Tensor forward(const Tensor& x) override { return forward_value(nn::Value(x)).tensor(); }
  nn::Value forward_value(const nn::Value& x) override {
    auto e = engine_.lock();
    if (!e) return inner_->forward_value(x);
    e->before_unit_forward(bucket_);
    nn::Value y = inner_->forward_value(x);
    y = hook_backward(y, e);
    e->after_unit_forward(bucket_);
    return y;
  }

 protected:
  std::shared_ptr<nn::Module> make_empty() const override {
    CHORUS_THROW(ValueError, "a ShardedDataParallel unit cannot be cloned; clone the module before sharding it");
  }

 private:
  // The output passes through an identity whose backward gathers the unit
  // again before any of its own backward ops runs.
  nn::Value hook_backward(const nn::Value& y, const std::shared_ptr<Impl>& e) {
    if (!y.is_tensor()) return y;
    const Tensor& t = y.tensor();
    if (!grad_enabled() || !t.requires_grad()) return y;
    std::weak_ptr<Impl> weak = e;
    const size_t b = bucket_;
    return nn::Value(autograd::record("ShardedUnitPreBackward", t.detach(), {t}, [weak, b](const TensorList& g) {
      if (auto st = weak.lock()) st->before_unit_backward(b);
      return TensorList{g[0]};
    }));
  }
  nn::ModulePtr inner_;
  std::weak_ptr<Impl> engine_;
  size_t bucket_;
};

// ---- construction ----------------------------------------------------------------------

ShardedDataParallel::ShardedDataParallel(nn::ModulePtr module, ProcessGroupPtr group, ShardOptions options)
    : nn::Module("ShardedDataParallel"), module_(std::move(module)), impl_(std::make_shared<Impl>()) {
  CHORUS_CHECK(module_ != nullptr, "ShardedDataParallel: module is null");
  CHORUS_CHECK(group != nullptr, "ShardedDataParallel: the process group is null");
  CHORUS_CHECK(options.stage >= 1 && options.stage <= 3, "ShardedDataParallel: the stage must be 1, 2 or 3, got ",
               options.stage);
  CHORUS_CHECK(options.bucket_bytes >= 0, "ShardedDataParallel: bucket_bytes must be >= 0, got ",
               options.bucket_bytes);
  CHORUS_CHECK(!options.reduce_dtype || is_floating(*options.reduce_dtype),
               "ShardedDataParallel: reduce_dtype must be a floating type, got ", dtype_name(*options.reduce_dtype));
  register_child("", module_);  // state-dict names stay the module's own
  Impl& s = *impl_;
  s.self = impl_;
  s.group = std::move(group);
  s.options = options;
  s.world = s.group->size();
  s.rank = s.group->rank();
  const int instance = next_sharded_instance.fetch_add(1);

  ReplicaParameters rp = check_replica(*module_, *s.group, "ShardedDataParallel",
                                       "sdp/" + std::to_string(instance), /*group_device_only=*/true);
  s.names = rp.names;
  s.params = rp.trainable;
  for (size_t k = 0; k < s.params.size(); ++k)
    CHORUS_CHECK(s.params[k].is_contiguous(), "ShardedDataParallel: parameter '", s.names[k],
                 "' is not contiguous (", s.params[k].describe(),
                 "): shards are ranges of a parameter's row-major elements");
  // Mixed precision: which parameters are held in param_dtype while gathered.
  for (size_t k = 0; k < s.params.size(); ++k) s.master_dtypes.push_back(s.params[k].dtype());
  s.full_dtypes = s.master_dtypes;
  if (options.param_dtype) {
    CHORUS_CHECK(is_floating(*options.param_dtype), "ShardedDataParallel: param_dtype must be a floating type, got ",
                 dtype_name(*options.param_dtype));
    for (size_t k = 0; k < s.params.size(); ++k)
      if (is_floating(s.params[k].dtype()) &&
          (!options.param_dtype_for || options.param_dtype_for(s.names[k], s.params[k])))
        s.full_dtypes[k] = *options.param_dtype;
  }
  NoGradGuard no_grad;
  // Rank 0's values: the frozen parameters here, the trainable ones bucket by
  // bucket below (one bucket's flat copy at a time, never the whole model's).
  if (s.world > 1) broadcast_in_place(*s.group, rp.frozen);
  s.buffers = flatten_module_buffers(*module_);
  if (s.buffers && s.world > 1) broadcast_module_buffers(*s.buffers, *s.group, *module_);

  // The plan: stage 3 one bucket per unit (the root unit last, it finishes
  // the backward), stages 1-2 by size.
  std::unordered_map<const TensorImpl*, size_t> index;
  for (size_t k = 0; k < s.params.size(); ++k) index[s.params[k].impl()] = k;
  std::vector<nn::ModulePtr> units;
  if (options.stage == 3) {
    units = options.units;
    if (units.empty()) find_shard_units(module_, &units);
    // A parameter two units share (a tied weight) belongs to the root unit:
    // gathered for the whole step, it is there whichever unit reads it.
    std::vector<int> in_units(s.params.size(), 0);
    for (const nn::ModulePtr& u : units) {
      CHORUS_CHECK(u != nullptr, "ShardedDataParallel: a unit is null");
      for (const Tensor& p : u->parameters())
        if (auto it = index.find(p.impl()); it != index.end()) ++in_units[it->second];
    }
    std::vector<char> taken(s.params.size(), 0);
    for (size_t k = 0; k < s.params.size(); ++k) taken[k] = in_units[k] > 1;
    std::vector<std::vector<size_t>> groups;
    std::vector<nn::ModulePtr> kept;
    for (const nn::ModulePtr& u : units) {
      std::vector<size_t> ks;
      for (const Tensor& p : u->parameters())
        if (auto it = index.find(p.impl()); it != index.end() && !taken[it->second]) {
          taken[it->second] = 1;
          ks.push_back(it->second);
        }
      if (ks.empty()) continue;
      groups.push_back(ks);
      kept.push_back(u);
    }
    // Buckets launch their reduce-scatters in index order, and the backward
    // finishes the units last to first: the last unit's bucket comes first,
    // so that each launches as soon as its gradients are ready (in forward
    // order every unit's full gradients would wait for the first unit's:
    // the whole model's, at once).
    std::reverse(groups.begin(), groups.end());
    std::reverse(kept.begin(), kept.end());
    std::vector<size_t> root;
    for (size_t k = 0; k < s.params.size(); ++k)
      if (!taken[k] || in_units[k] > 1) root.push_back(k);
    if (!root.empty()) groups.push_back(root);
    units = kept;
    s.plan = GradBuckets::from_groups(s.params, groups, s.full_dtypes);
  } else {
    s.plan = GradBuckets(s.params, options.bucket_bytes, 0, {}, 0, s.full_dtypes);
  }

  // The flat buffers; the parameters become views of `full`.
  s.buckets.resize(s.plan.size());
  s.pieces_of.assign(s.params.size(), {});
  for (size_t b = 0; b < s.plan.size(); ++b) {
    const GradBuckets::Bucket& pb = s.plan.buckets[b];
    Impl::Bucket& bk = s.buckets[b];
    bk.unit = b < units.size() ? static_cast<int>(b) : -1;
    for (size_t g = 0; g < pb.layout.groups(); ++g) {
      Impl::Flat f;
      f.dtype = pb.layout.dtypes[g];
      f.padded = s.plan.padded_numel(b, g, s.world);
      f.per = f.padded / s.world;
      // The masters' dtype: one per group (a group of param_dtype holds
      // parameters of one dtype before wrapping).
      f.master_dtype = kFloat32;
      bool first = true;
      for (size_t i = 0; i < pb.ks.size(); ++i)
        if (pb.layout.segments[i].group == g) {
          const DType md = s.master_dtypes[pb.ks[i]];
          CHORUS_CHECK(first || md == f.master_dtype, "ShardedDataParallel: param_dtype ", dtype_name(f.dtype),
                       " would hold parameters of two dtypes (", dtype_name(f.master_dtype), ", ", dtype_name(md),
                       ") in one buffer; '", s.names[pb.ks[i]], "' is one");
          f.master_dtype = md;
          first = false;
        }
      const bool cast = f.master_dtype != f.dtype;
      // This rank's values into a full buffer of the masters' dtype, rank 0's
      // over them, then the shard; cast, the full buffer is made from it.
      Tensor staging = zeros({f.padded}, TensorOptions(f.master_dtype, pb.device));
      const GradBuckets::Range mine = s.plan.shard(b, g, s.rank, s.world);
      TensorList srcs, dsts;
      for (size_t i = 0; i < pb.ks.size(); ++i)
        if (pb.layout.segments[i].group == g) {
          srcs.push_back(s.params[pb.ks[i]]);
          dsts.push_back(pb.layout.view(staging, i));
        }
      ops::copy_multi(srcs, dsts);
      if (s.world > 1) s.group->broadcast(staging, 0)->wait();
      if (options.stage == 3 || cast) {
        f.master = ops::clone(staging.narrow(0, mine.begin, f.per));
      } else {
        f.master = staging.narrow(0, mine.begin, f.per);
      }
      f.full = cast ? ops::to_dtype(staging, f.dtype) : staging;
      staging = Tensor();
      f.grad_shard = zeros({f.per}, TensorOptions(f.master_dtype, pb.device));
      if (options.stage == 1) f.grad_full = zeros({f.padded}, TensorOptions(f.dtype, pb.device));
      bk.flats.push_back(std::move(f));
    }
    // Re-point each parameter at its view of the full buffer (same
    // TensorImpl: the module and anyone holding it see the change). At stage
    // 3 autocast casts the weights at each use: a kept 16-bit copy of each
    // would outlive the gathered weights, a second whole model.
    for (size_t i = 0; i < pb.ks.size(); ++i) {
      if (options.stage == 3)
        if (AutogradMeta* m = s.params[pb.ks[i]].autograd_meta()) m->no_kept_copy = true;
      Tensor v = pb.layout.view(bk.flats[pb.layout.segments[i].group].full, i);
      TensorImpl* p = s.params[pb.ks[i]].impl();
      p->storage = v.storage();
      p->offset = v.storage_offset();
      p->strides = v.strides();
      p->dtype = v.dtype();
    }
    bk.gathered = true;
    bk.stale = false;
  }
  // The optimizer's pieces, in the module's parameter order.
  for (size_t k = 0; k < s.params.size(); ++k) {
    const GradBuckets::Place pl = s.plan.place(k);
    const GradBuckets::Range r = s.plan.shard_of_param(k, s.rank, s.world);
    if (r.numel() == 0) continue;
    const Impl::Flat& f = s.buckets[pl.bucket].flats[pl.group];
    const GradBuckets::Range mine = s.plan.shard(pl.bucket, pl.group, s.rank, s.world);
    Tensor piece = f.master.narrow(0, r.begin - mine.begin, r.numel()).detach();
    piece.set_requires_grad(true);
    s.pieces_of[k].push_back(s.shard_params.size());
    s.piece_flat.emplace_back(pl.bucket, pl.group);
    s.piece_offset.push_back(r.begin - mine.begin);
    s.pieces.push_back({s.names[k], k, s.params[k].sizes(), s.master_dtypes[k], r.begin - pl.offset, r.end - pl.offset});
    s.shard_params.push_back(piece);
  }
  if (options.stage == 3) {
    for (size_t u = 0; u < units.size(); ++u) s.unit_names.push_back("");
    s.unit_names.resize(s.plan.size(), "");
    // Replace each unit in its parent by its wrapper.
    std::unordered_map<const nn::Module*, size_t> unit_of;
    for (size_t u = 0; u < units.size(); ++u) unit_of[units[u].get()] = u;
    std::vector<std::pair<std::string, nn::ModulePtr>> stack{{"", module_}};
    while (!stack.empty()) {
      auto [prefix, m] = stack.back();
      stack.pop_back();
      for (auto& [name, child] : m->own_children()) {
        const std::string full = prefix.empty() ? name : name.empty() ? prefix : prefix + "." + name;
        if (auto it = unit_of.find(child.get()); it != unit_of.end()) {
          s.unit_names[it->second] = full;
          child = std::make_shared<Unit>(child, impl_, it->second);
        } else {
          stack.emplace_back(full, child);
        }
      }
    }
    if (!options.units.empty()) {
      // Named units are trusted: sharded now, the rest of their weights freed.
      for (size_t b = 0; b < s.buckets.size(); ++b) s.buckets[b].sharded = s.buckets[b].unit >= 0;
      s.units_decided = true;
      for (size_t b = 0; b < s.buckets.size(); ++b)
        if (!s.gathered_whole_step(b)) s.release(b);
    }
    // Otherwise every unit stays gathered until its wrapper has run once
    // (Note [Sharded units]): the first step shows which wrappers the forward
    // calls.
  }
  std::weak_ptr<Impl> weak = impl_;
  for (size_t k = 0; k < s.params.size(); ++k)
    s.params[k].register_post_accumulate_hook(
        [weak, k](Tensor&) {
          if (auto st = weak.lock()) st->on_grad_ready(k);
        },
        /*reads_grad=*/false);  // launch() reads it
  observer_handle_ = autograd::add_backward_observer(impl_);
}

ShardedDataParallel::~ShardedDataParallel() = default;

// ---- use -----------------------------------------------------------------------------

Tensor ShardedDataParallel::forward(const Tensor& x) { return forward_value(nn::Value(x)).tensor(); }

nn::Value ShardedDataParallel::forward_value(const nn::Value& x) {
  Impl& s = *impl_;
  {
    std::lock_guard<std::mutex> lk(s.mu);
    CHORUS_CHECK(!s.in_backward, "ShardedDataParallel: forward while a backward is running");
    if (s.options.broadcast_buffers && is_training() && s.buffers) {
      NoGradGuard no_grad;
      broadcast_module_buffers(*s.buffers, *s.group, *module_);
    }
    const bool training = grad_enabled() && is_training();
    if (training)
      for (auto& bk : s.buckets) bk.held = false;
    NoGradGuard no_grad;
    for (size_t b = 0; b < s.buckets.size(); ++b)
      if (!s.stage3() || s.gathered_whole_step(b)) s.wait_gather(b);
    s.arm_next = training && !s.no_sync;
  }
  return module_->forward_value(x);
}

Tensor ShardedDataParallel::clip_grad_norm(double max_norm) {
  Impl& s = *impl_;
  const Device home = s.params[0].device();
  // The masters' dtype (the gathered parameters may be 16-bit: param_dtype).
  const DType acc = s.master_dtypes[0] == kFloat64 ? kFloat64 : kFloat32;
  auto total_of = [&s](const Tensor& sq) {
    if (s.world > 1) s.group->all_reduce(sq, ReduceOp::Sum)->wait();
    // Hybrid: the replicas hold the same shards: their sum is not added.
  };
  NoGradGuard no_grad;
  TensorList grads;
  for (const Tensor& p : s.shard_params)
    if (Tensor g = p.grad(); g.defined()) grads.push_back(g);
  return ops::clip_by_global_norm_(grads, max_norm, home, acc, total_of);
}

void ShardedDataParallel::gather_parameters() {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lk(s.mu);
  NoGradGuard no_grad;
  for (size_t b = 0; b < s.buckets.size(); ++b) {
    s.wait_gather(b);
    s.buckets[b].held = true;
  }
}

NamedTensors ShardedDataParallel::full_parameters() {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lk(s.mu);
  NoGradGuard no_grad;
  std::vector<Tensor> whole(s.params.size());
  for (size_t b = 0; b < s.plan.size(); ++b) {
    const GradBuckets::Bucket& pb = s.plan.buckets[b];
    for (size_t g = 0; g < s.buckets[b].flats.size(); ++g) {
      const Impl::Flat& f = s.buckets[b].flats[g];
      // The masters, not the gathered weights: param_dtype's would round.
      Tensor flat = empty({f.padded}, TensorOptions(f.master_dtype, pb.device));
      Tensor src = ops::clone(f.master);
      if (s.world > 1) s.group->all_gather(src, flat)->wait();
      else ops::copy_(flat, src);
      for (size_t i = 0; i < pb.ks.size(); ++i)
        if (pb.layout.segments[i].group == g) whole[pb.ks[i]] = pb.layout.view(flat, i).to(cpu_device(0)).clone();
    }
  }
  NamedTensors out;
  for (size_t k = 0; k < s.params.size(); ++k) out.emplace_back(s.names[k], whole[k]);
  return out;
}

void ShardedDataParallel::load_shards(const std::function<Tensor(const Piece&)>& values) {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lk(s.mu);
  NoGradGuard no_grad;
  for (size_t i = 0; i < s.pieces.size(); ++i) {
    Tensor v = values(s.pieces[i]);
    const int64_t n = s.pieces[i].end - s.pieces[i].begin;
    CHORUS_CHECK(v.defined() && v.numel() == n, "ShardedDataParallel: the values loaded for '", s.pieces[i].name,
                 "' [", s.pieces[i].begin, ", ", s.pieces[i].end, ") hold ", v.defined() ? v.numel() : 0,
                 " elements, expected ", n);
    ops::copy_(s.shard_params[i], ops::to_device(v.reshape({n}), s.shard_params[i].device()));
    s.shard_params[i].bump_version();
  }
  for (auto& bk : s.buckets) {
    bk.stale = true;
    bk.held = false;
    if (!s.stage3()) bk.gathered = false;  // the next forward gathers
  }
  for (size_t b = 0; b < s.buckets.size(); ++b) s.release(b);
}

const std::vector<Tensor>& ShardedDataParallel::shard_parameters() const { return impl_->shard_params; }
const std::vector<ShardedDataParallel::Piece>& ShardedDataParallel::pieces() const { return impl_->pieces; }
const std::vector<std::string>& ShardedDataParallel::parameter_names() const { return impl_->names; }
const ProcessGroupPtr& ShardedDataParallel::process_group() const { return impl_->group; }
const ShardOptions& ShardedDataParallel::options() const { return impl_->options; }
const GradBuckets& ShardedDataParallel::buckets() const { return impl_->plan; }
std::vector<std::string> ShardedDataParallel::unit_names() const { return impl_->unit_names; }

std::vector<std::string> ShardedDataParallel::unused_parameters() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->unused_names;
}

ShardedDataParallel::Held ShardedDataParallel::held_bytes() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  Held h;
  for (const auto& bk : impl_->buckets)
    for (const auto& f : bk.flats) {
      if (bk.gathered) h.full_weights += static_cast<int64_t>(f.full.nbytes());
      if (impl_->stage3() || f.master_dtype != f.dtype) h.shard_weights += static_cast<int64_t>(f.master.nbytes());
      if (f.grad_full.defined()) h.full_grads += static_cast<int64_t>(f.grad_full.nbytes());
      h.shard_grads += static_cast<int64_t>(f.grad_shard.nbytes());
    }
  h.peak_full_grads = impl_->peak_full_grads;
  for (size_t b = 0; b < impl_->buckets.size(); ++b) {
    int64_t bytes = 0;
    for (const auto& f : impl_->buckets[b].flats) bytes += f.padded * static_cast<int64_t>(dtype_size(f.dtype));
    h.largest_bucket_grads = std::max(h.largest_bucket_grads, bytes);
  }
  return h;
}

ShardedDataParallel::NoSync ShardedDataParallel::no_sync() { return NoSync(impl_, impl_->mu, impl_->no_sync); }

std::shared_ptr<nn::Module> ShardedDataParallel::make_empty() const {
  CHORUS_THROW(ValueError, "ShardedDataParallel cannot be cloned; clone its module() instead");
}

}  // namespace chorus::dist
