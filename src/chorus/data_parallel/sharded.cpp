// ShardedDataParallel (sharded.h): its construction (the pieces, buckets and
// stage 3's units), forward, gradient clipping and accessors. The engine that
// gathers and reduce-scatters is in sharded_engine.h; the state read and
// loaded outside a step in sharded_state.cpp.
#include "chorus/data_parallel/sharded.h"
#include "chorus/data_parallel/sharded_engine.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>

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

// ---- the unit wrapper ----------------------------------------------------------------

// Note [Sharded units]: stands in its parent for the unit module (stages 1-2:
// Note [Gathers beside the forward]).
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
    if (e->stage3()) y = hook_backward(y, e);  // stages 1-2 gather nothing in the backward
    e->after_unit_forward(bucket_);
    return y;
  }

 protected:
  std::shared_ptr<nn::Module> make_empty() const override {
    CHORUS_THROW(ValueError, "a ShardedDataParallel unit cannot be cloned; clone the module before sharding it");
  }

 private:
  // The output passes through an identity whose backward gathers the unit
  // again before any of its own backward ops runs: each tensor of it, where
  // it is a list (a GPT block's pending residual pair: Note [Pending
  // residual] in models/gpt.h); the first to run gathers.
  nn::Value hook_backward(const nn::Value& y, const std::shared_ptr<Impl>& e) {
    if (y.is_list()) {
      nn::Value::List out;
      for (const nn::Value& v : y.list()) out.push_back(hook_backward(v, e));
      return nn::Value(std::move(out));
    }
    if (!y.is_tensor()) return y;
    const Tensor& t = y.tensor();
    if (!t.defined() || !grad_enabled() || !t.requires_grad()) return y;
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
  // Replaces each unit in its parent by its wrapper (unit u calls the engine
  // with u: stage 3's bucket, stages 1-2's index in unit_gathers); returns
  // the units' module names.
  auto wrap_units = [&](const std::vector<nn::ModulePtr>& us) {
    std::vector<std::string> found(us.size());
    std::unordered_map<const nn::Module*, size_t> unit_of;
    for (size_t u = 0; u < us.size(); ++u) unit_of[us[u].get()] = u;
    std::vector<std::pair<std::string, nn::ModulePtr>> stack{{"", module_}};
    while (!stack.empty()) {
      auto [prefix, m] = stack.back();
      stack.pop_back();
      for (auto& [name, child] : m->own_children()) {
        const std::string full = prefix.empty() ? name : name.empty() ? prefix : prefix + "." + name;
        if (auto it = unit_of.find(child.get()); it != unit_of.end()) {
          found[it->second] = full;
          child = std::make_shared<Unit>(child, impl_, it->second);
        } else {
          stack.emplace_back(full, child);
        }
      }
    }
    return found;
  };
  if (options.stage < 3 && !options.units.empty()) {
    // Note [Gathers beside the forward] (sharded.h): which buckets each unit
    // waits for, which the module's forward does, and the order of issue.
    const size_t nb = s.plan.size();
    std::vector<int> unit_of_param(s.params.size(), -1);  // -1: the root (no unit, or two)
    for (size_t u = 0; u < options.units.size(); ++u) {
      CHORUS_CHECK(options.units[u] != nullptr, "ShardedDataParallel: a unit is null");
      for (const Tensor& p : options.units[u]->parameters())
        if (auto it = index.find(p.impl()); it != index.end())
          unit_of_param[it->second] = unit_of_param[it->second] == -1 ? static_cast<int>(u) : -2;
    }
    s.root_gather.assign(nb, 0);
    s.unit_gathers.assign(options.units.size(), {});
    s.unit_ran.assign(options.units.size(), 0);
    for (size_t b = 0; b < nb; ++b)
      for (size_t k : s.plan.buckets[b].ks) s.root_gather[b] |= unit_of_param[k] < 0 ? 1 : 0;
    for (size_t b = nb; b-- > 0;) {
      if (s.root_gather[b]) continue;
      for (size_t k : s.plan.buckets[b].ks) {
        auto& ug = s.unit_gathers[static_cast<size_t>(unit_of_param[k])];
        if (std::find(ug.begin(), ug.end(), b) == ug.end()) ug.push_back(b);
      }
    }
    // The root's buckets first, then the rest from the last bucket down: the
    // plan holds the parameters from the last to the first, so that is the
    // order in which the forward reaches them.
    for (size_t b = nb; b-- > 0;)
      if (s.root_gather[b]) s.gather_order.push_back(b);
    for (size_t b = nb; b-- > 0;)
      if (!s.root_gather[b]) s.gather_order.push_back(b);
    wrap_units(options.units);
  }
  if (options.stage == 3) {
    s.unit_names = wrap_units(units);
    s.unit_names.resize(s.plan.size(), "");
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
    if (training && capture_in_progress()) {
      // Note [Sharded steps in a CUDA graph]: the graph must hold every
      // gather, which a replay needs to bring the new shards in. Weights
      // still gathered now (gather_parameters() for an evaluation between
      // the eager steps and this capture) would be skipped and the replays
      // would compute with these forever: they are gathered again.
      for (size_t b = 0; b < s.buckets.size(); ++b) {
        if (!s.buckets[b].gathered) continue;
        if (s.stage3())
          s.release(b);
        else
          s.buckets[b].gathered = false;
      }
    }
    NoGradGuard no_grad;
    if (s.gathers_beside_forward()) {
      // Note [Gathers beside the forward]: all issued now, in the order the
      // forward reaches them; each unit waits for its own (every gather
      // waited for here until the first synced step has shown which units'
      // wrappers run).
      for (size_t b : s.gather_order) s.issue_gather(b);
      for (size_t b : s.gather_order)
        if (s.root_gather[b] || !s.unit_waits_decided) s.wait_gather(b);
    } else {
      for (size_t b = 0; b < s.buckets.size(); ++b)
        if (!s.stage3() || s.gathered_whole_step(b)) s.wait_gather(b);
    }
    s.arm_next = training && !s.no_sync;
  }
  nn::Value y = module_->forward_value(x);
  if (s.gathers_beside_forward()) {
    // A unit this forward did not run still has its gather in flight, made
    // of the shards as they are now: finished here, before any step can
    // change them under it.
    std::lock_guard<std::mutex> lk(s.mu);
    NoGradGuard no_grad;
    for (size_t b : s.gather_order) s.wait_gather(b);
  }
  return y;
}

namespace {

// What both clipping forms need: this rank's gradient shards, the masters'
// accumulation dtype (the gathered parameters may be 16-bit: param_dtype),
// and the all-reduce that makes this rank's sum of squares the total over
// the shards.
struct ShardNormInputs {
  TensorList grads;
  Device home;
  DType acc;
  std::function<void(const Tensor&)> total_of;
};

ShardNormInputs shard_norm_inputs(const std::vector<Tensor>& shard_params, const std::vector<DType>& masters,
                                  const ProcessGroupPtr& group, int world, const Device& home) {
  ShardNormInputs in{{}, home, masters[0] == kFloat64 ? kFloat64 : kFloat32, {}};
  // Hybrid: the replicas hold the same shards: their sum is not added.
  in.total_of = [group, world](const Tensor& sq) {
    if (world > 1) group->all_reduce(sq, ReduceOp::Sum)->wait();
  };
  for (const Tensor& p : shard_params)
    if (Tensor g = p.grad(); g.defined()) in.grads.push_back(g);
  return in;
}

}  // namespace

Tensor ShardedDataParallel::clip_grad_norm(double max_norm) {
  Impl& s = *impl_;
  NoGradGuard no_grad;
  ShardNormInputs in = shard_norm_inputs(s.shard_params, s.master_dtypes, s.group, s.world, s.params[0].device());
  return ops::clip_by_global_norm_(in.grads, max_norm, in.home, in.acc, in.total_of);
}

ops::NormAndScale ShardedDataParallel::clip_grad_norm_scale(double max_norm) {
  Impl& s = *impl_;
  NoGradGuard no_grad;
  ShardNormInputs in = shard_norm_inputs(s.shard_params, s.master_dtypes, s.group, s.world, s.params[0].device());
  return ops::global_norm_and_scale(in.grads, max_norm, in.home, in.acc, in.total_of);
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

ShardedDataParallel::NoSync ShardedDataParallel::no_sync() { return NoSync(impl_, impl_->mu, impl_->no_sync); }

std::shared_ptr<nn::Module> ShardedDataParallel::make_empty() const {
  CHORUS_THROW(ValueError, "ShardedDataParallel cannot be cloned; clone its module() instead");
}

}  // namespace chorus::dist
