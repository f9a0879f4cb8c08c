#include "chorus/parallel/data_parallel.h"

#include <algorithm>
#include <cstddef>
#include <optional>
#include <unordered_map>

#include "chorus/autograd/functions.h"
#include "chorus/autograd/grad_mode.h"
#include "chorus/autograd/node.h"
#include "chorus/autograd/grad_finisher.h"
#include "chorus/core/error.h"
#include "chorus/core/graph_capture.h"
#include "chorus/core/stream.h"
#include "chorus/data_parallel/sync_batch_norm.h"
#include "chorus/ops/comm.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/factory.h"
#include "chorus/parallel/scatter_gather.h"

namespace chorus::parallel {

struct DataParallel::Entry {
  bool is_param = false;
  Tensor master;                            // parameters: the leaf the optimizer updates
  Tensor* master_slot = nullptr;            // buffers: the wrapped module's slot, read at each sync
  std::vector<std::vector<Tensor*>> slots;  // [replica] the slots that hold it (0: the wrapped module's)
  // What replica r's copy was made from: the master's version counter and its
  // value, and the replica view's own version then (a replica's batch norm
  // updates its copy of the running statistics in place).
  struct Synced {
    std::shared_ptr<uint32_t> counter;
    uint32_t master_version = 0;
    uint32_t replica_version = 0;
  };
  std::vector<Synced> synced;  // [replica]

  const Tensor& current() const { return is_param ? master : *master_slot; }
};

namespace {

using dist::FlatLayout;

// Parameter and buffer slots of a module tree, in a fixed walk order.
void walk(nn::Module& m, std::vector<Tensor*>* params, std::vector<Tensor*>* buffers) {
  for (auto& [n, t] : m.own_parameters()) params->push_back(&t);
  for (auto& [n, t] : m.own_buffers()) buffers->push_back(&t);
  for (auto& [n, c] : m.named_children()) walk(*c, params, buffers);
}

// The AccumulateGrad edges of the input's leaves that require grad. Made on the
// caller's thread before the replicas run, and held until they finish, so the
// replica threads (which each narrow the same leaf) only read the leaf's cached
// node; creating it from several threads at once races on its AutogradMeta.
void leaf_edges(const nn::Value& x, std::vector<autograd::Edge>* out) {
  if (x.is_tensor()) {
    const Tensor& t = x.tensor();
    if (t.defined() && t.requires_grad() && t.is_leaf()) out->push_back(autograd::gradient_edge(t));
  } else if (x.is_list()) {
    for (const auto& e : x.list()) leaf_edges(e, out);
  } else {
    for (const auto& [k, e] : x.map()) leaf_edges(e, out);
  }
}

}  // namespace

DataParallel::DataParallel(nn::ModulePtr module, std::vector<Device> devices, DataParallelOptions options)
    : nn::Module("DataParallel"), module_(std::move(module)), devices_(std::move(devices)), options_(options) {
  CHORUS_CHECK(module_ != nullptr, "DataParallel: module is null");
  CHORUS_CHECK(!devices_.empty(), "DataParallel: the device list is empty");
  CHORUS_CHECK(options_.bucket_bytes >= 0, "DataParallel: bucket_bytes must be >= 0 (0: one bucket), got ",
               options_.bucket_bytes);
  CHORUS_CHECK(options_.last_bucket_bytes >= 0, "DataParallel: last_bucket_bytes must be >= 0 (0: none), got ",
               options_.last_bucket_bytes);
  CHORUS_CHECK(options_.in_place_min_bytes >= 0, "DataParallel: in_place_min_bytes must be >= 0, got ",
               options_.in_place_min_bytes);
  for (size_t i = 0; i < devices_.size(); ++i) {
    check_device(devices_[i]);
    for (size_t j = 0; j < i; ++j)
      CHORUS_CHECK(devices_[i] != devices_[j], "DataParallel: device ", devices_[i].str(),
                   " appears twice in the device list");
  }
  for (auto& [name, p] : module_->named_parameters())
    CHORUS_CHECK(p.device() == devices_[0], "DataParallel: parameter '", name, "' is on ", p.device().str(),
                 " but the module must be on the first device, ", devices_[0].str(), " (call module->to(",
                 devices_[0].str(), ") first)");
  if (options_.output_device) check_device(*options_.output_device);
  register_child("", module_);  // no name: state_dict keys stay the module's own

  replicas_.push_back(module_);
  for (size_t r = 1; r < devices_.size(); ++r) replicas_.push_back(module_->clone(devices_[r]));

  // One entry per distinct master tensor (a shared parameter is one entry with
  // several slots), parameters first.
  const size_t n = devices_.size();
  std::vector<std::vector<Tensor*>> params(n), buffers(n);
  for (size_t r = 0; r < n; ++r) walk(*replicas_[r], &params[r], &buffers[r]);
  auto collect = [&](const std::vector<std::vector<Tensor*>>& slots, bool is_param) {
    std::unordered_map<const TensorImpl*, size_t> by_master;
    for (size_t i = 0; i < slots[0].size(); ++i) {
      Tensor& m = *slots[0][i];
      if (!m.defined()) continue;
      auto [it, fresh] = by_master.emplace(m.impl(), entries_.size());
      if (fresh) {
        Entry e;
        e.is_param = is_param;
        if (is_param) e.master = m;
        else e.master_slot = slots[0][i];
        e.slots.resize(n);
        e.synced.resize(n);
        entries_.push_back(std::move(e));
      }
      for (size_t r = 0; r < n; ++r) entries_[it->second].slots[r].push_back(slots[r][i]);
    }
  };
  collect(params, true);
  num_params_ = entries_.size();
  collect(buffers, false);

  std::vector<Tensor> masters;
  for (const Entry& e : entries_) masters.push_back(e.current());
  layout_ = std::make_shared<const FlatLayout>(masters);
  flat_.resize(n);
  views_.resize(n);
  if (n > 1) {
    for (size_t g = 0; g < layout_->groups(); ++g)
      staging_.push_back(empty({layout_->numels[g]}, TensorOptions(layout_->dtypes[g], devices_[0])));
    for (size_t e = 0; e < entries_.size(); ++e)
      staging_views_.push_back(layout_->view(staging_[layout_->segments[e].group], e));
  }
  for (size_t r = 1; r < n; ++r) {
    for (size_t g = 0; g < layout_->groups(); ++g)
      flat_[r].push_back(empty({layout_->numels[g]}, TensorOptions(layout_->dtypes[g], devices_[r])));
    for (size_t e = 0; e < entries_.size(); ++e) {
      views_[r].push_back(layout_->view(flat_[r][layout_->segments[e].group], e));
      for (Tensor* slot : entries_[e].slots[r]) *slot = views_[r][e];
    }
  }
  threads_ = std::make_unique<DeviceThreads>(devices_);
  stepped_.assign(entries_.size(), 0);
  self_ = std::make_shared<DataParallel*>(this);
  wire_sync_batch_norm();
  sync_replicas(n);  // every replica valid from the start, not only after a forward
}

void DataParallel::wire_sync_batch_norm() {
  // Note [DataParallel and SyncBatchNorm]. modules() walks every replica in the
  // same order, so position i is the same layer in each.
  auto masters = module_->modules();
  std::vector<std::vector<nn::ModulePtr>> reps;
  for (const nn::ModulePtr& r : replicas_) reps.push_back(r->modules());
  for (size_t i = 0; i < masters.size(); ++i) {
    auto master = std::dynamic_pointer_cast<dist::SyncBatchNorm>(masters[i]);
    if (!master) continue;
    const dist::ProcessGroupPtr& pg = master->process_group();
    auto across = pg ? std::make_shared<dist::ProcessStatsGroup>(pg) : nullptr;
    auto group = std::make_shared<dist::ReplicaStatsGroup>(
        static_cast<int>(replicas_.size()), across,
        pg ? pg->options().timeout : std::chrono::milliseconds(std::chrono::seconds(300)));
    for (size_t r = 0; r < replicas_.size(); ++r) {
      auto bn = std::dynamic_pointer_cast<dist::SyncBatchNorm>(reps[r].at(i));
      CHORUS_ASSERT(bn != nullptr);
      bn->set_stats_group(group, static_cast<int>(r));
    }
    stats_groups_.push_back(group);
  }
}

DataParallel::~DataParallel() = default;

ReplicatedUpdates DataParallel::replicate_updates(const std::vector<Tensor>& params) {
  std::unordered_map<const TensorImpl*, size_t> entry_of;
  for (size_t e = 0; e < num_params_; ++e) entry_of.emplace(entries_[e].master.impl(), e);
  CHORUS_CHECK(!options_.comm_hook || options_.comm_hook->all_reduces(), "DataParallel: replicate_updates needs a "
               "communication hook that leaves the sum on every replica (all_reduces()); the options' comm_hook does not");
  ReplicatedUpdates u;
  // Several optimizers (parameter groups of their own) may each step theirs.
  std::vector<char> stepped = stepped_;
  for (size_t i = 0; i < params.size(); ++i) {
    auto it = entry_of.find(params[i].impl());
    CHORUS_CHECK(it != entry_of.end(), "DataParallel: replicate_updates: tensor ", i, " (", params[i].describe(),
                 ") is not a parameter of the wrapped module");
    stepped[it->second] = 1;
    for (size_t r = 1; r < devices_.size(); ++r) u.copies.emplace_back(i, views_[r][it->second]);
  }
  stepped_ = std::move(stepped);
  replicated_ = true;
  reducer_.reset();  // the next forward records with an all-reducing comm
  std::weak_ptr<DataParallel*> weak = self_;
  u.after_step = [weak] {
    if (auto self = weak.lock(); self && *self) (*self)->note_replicated_step();
  };
  return u;
}

void DataParallel::note_replicated_step() {
  // Bookkeeping of values: never changed by a capture (a failed one must leave
  // it as it was, Note [CUDA graphs]); the next eager forward re-checks.
  if (capture_in_progress()) return;
  for (size_t e = 0; e < num_params_; ++e) {
    if (!stepped_[e]) continue;
    const Tensor& m = entries_[e].master;
    // In sync before the step, and the master changed by the step alone (one
    // version bump when it had a gradient): the replicas took the same step.
    // (Not m.grad(), which would add a pending part: Note [Gradient sums in
    // the update] in data_parallel/reducer.h.)
    const uint32_t bumps = autograd::unfinished_grad(m).defined() ? 1 : 0;
    for (size_t r = 1; r < devices_.size(); ++r) {
      Entry::Synced& sy = entries_[e].synced[r];
      if (sy.counter.get() != m.impl()->version.get() || sy.master_version + bumps != m.version()) continue;
      sy = {m.impl()->version, m.version(), views_[r][e].version()};
    }
  }
}

std::shared_ptr<nn::Module> DataParallel::make_empty() const {
  CHORUS_THROW(ValueError, "DataParallel cannot be cloned; clone its module() instead");
}

void DataParallel::sync_replicas(size_t used) {
  // Replicas [1, used) whose copy of any tensor of a dtype group is stale get
  // the whole group: pack the masters (one multi-tensor copy) and broadcast.
  // Per replica: a small batch leaves the idle replicas behind, and they catch
  // up when a later batch uses them again. Raw ops:: calls: never recorded.
  const size_t groups = layout_->groups();
  // In a CUDA graph capture every group is copied: the graph's own optimizer
  // step changes the masters at every replay, and a failed capture must
  // leave the bookkeeping as it was (Note [CUDA graphs]).
  // (One replica in use: there is nothing to copy, and a DataParallel over
  // one device has no staging buffers.)
  const bool capturing = capture_in_progress() && used > 1;
  // Note [Replicated updates]: the graph's optimizer step updates the
  // replicas too, so a capture copies only what is stale now; and while every
  // module trains, buffers are not copied at all.
  const bool copy_all = capturing && !replicated_;
  bool all_training = true;
  if (replicated_)
    for (const nn::ModulePtr& m : module_->modules()) all_training = all_training && m->is_training();
  std::vector<char> stale(groups, copy_all ? 1 : 0);
  for (size_t e = 0; e < entries_.size() && !copy_all; ++e) {
    const Entry& entry = entries_[e];
    if (replicated_ && !entry.is_param && all_training) continue;
    const Tensor& m = entry.current();
    // A replica's views share its flat buffer's version counter, which its
    // own batch-norm updates move every training forward: with replicated
    // updates a stepped parameter's copy is judged by its master alone (only
    // this class and the optimizer write it).
    const bool master_only = replicated_ && entry.is_param && stepped_[e];
    for (size_t r = 1; r < used; ++r) {
      const Entry::Synced& s = entry.synced[r];
      if (s.counter.get() != m.impl()->version.get() || s.master_version != m.version() ||
          (!master_only && s.replica_version != views_[r][e].version()))
        stale[layout_->segments[e].group] = 1;
    }
  }
  for (size_t g = 0; g < groups; ++g) {
    if (!stale[g]) continue;
    // Packed with one multi-tensor copy (Note [Multi-tensor copy] in
    // ops/copy.h): a few launches for the whole model instead of one each.
    TensorList masters, packed;
    for (size_t e = 0; e < entries_.size(); ++e) {
      if (layout_->segments[e].group != g) continue;
      const Tensor& m = entries_[e].current();
      CHORUS_CHECK(layout_->matches(e, m), "DataParallel: a ", entries_[e].is_param ? "parameter" : "buffer",
                   " of the wrapped module is now ", m.describe(), " but was ",
                   dtype_name(layout_->dtypes[g]), shape_str(layout_->segments[e].sizes),
                   " when the DataParallel was built; build it after changing the module");
      masters.push_back(m);
      packed.push_back(staging_views_[e]);
    }
    ops::copy_multi(masters, packed);
    std::vector<Tensor> dsts;
    for (size_t r = 1; r < used; ++r) dsts.push_back(flat_[r][g]);
    ops::broadcast_coalesced(staging_[g], dsts);
    // The broadcast wrote the flat buffers under the views, whose version
    // counters are their own: what reads a view's version (autocast's kept
    // 16-bit copies, saved tensors) must see the new values.
    for (size_t e = 0; e < entries_.size(); ++e)
      if (layout_->segments[e].group == g)
        for (size_t r = 1; r < used; ++r) views_[r][e].bump_version();
    if (capturing) continue;  // the replicas are copied at every replay
    for (size_t e = 0; e < entries_.size(); ++e) {
      if (layout_->segments[e].group != g) continue;
      const Tensor& m = entries_[e].current();
      for (size_t r = 1; r < used; ++r)
        entries_[e].synced[r] = {m.impl()->version, m.version(), views_[r][e].version()};
    }
  }
  // The slots hold the plain views (a forward with grad replaces the
  // parameters' with recorded ones); a replaced buffer is pointed back too.
  for (size_t r = 1; r < used; ++r)
    for (size_t e = 0; e < entries_.size(); ++e)
      for (Tensor* slot : entries_[e].slots[r]) *slot = views_[r][e];
  // Train/eval mode follows the master module by module: replicas are not
  // children, so dp->eval() (or module()->eval(), or eval() on one submodule)
  // reaches them only here. modules() is pre-order, so a parent's recursive
  // train() is corrected by its children's entries that follow it.
  auto master_modules = module_->modules();
  for (size_t r = 1; r < used; ++r) {
    auto rep = replicas_[r]->modules();
    CHORUS_ASSERT(rep.size() == master_modules.size());
    for (size_t i = 0; i < rep.size(); ++i)
      if (rep[i]->is_training() != master_modules[i]->is_training()) rep[i]->train(master_modules[i]->is_training());
  }
}

void DataParallel::record_gradient_nodes(size_t used) {
  // Made on the caller's thread, before the replicas run: the AccumulateGrad
  // nodes of the masters are created here, once, not by several threads.
  std::vector<size_t> ge;
  for (size_t e = 0; e < num_params_; ++e)
    if (entries_[e].master.requires_grad()) ge.push_back(e);
  if (ge.empty()) return;
  if (ge != grad_entries_ || !reducer_) {
    std::vector<Tensor> ms;
    for (size_t e : ge) ms.push_back(entries_[e].master);
    // The strategy is chosen here, once per parameter set, from the options.
    std::shared_ptr<dist::CommHook> comm = options_.comm_hook;
    if (!comm && replicated_) comm = dist::make_all_reduce_hook(options_.grad_sum, options_.grads_in_place, devices_);
    if (!comm) comm = std::make_shared<dist::InProcessSum>();
    reducer_ = std::make_unique<dist::Reducer>(ms, std::move(comm),
                                               dist::ReducerOptions{options_.bucket_bytes, 0, options_.last_bucket_bytes,
                                                                    options_.in_place_min_bytes});
    grad_entries_ = ge;
  }
  // Replica 0 computes with aliases of the masters, so that its gradients too
  // take the flat path (Note [Gradient nodes] in data_parallel/reducer.h).
  std::vector<std::vector<Tensor>> replica_params(used);
  for (size_t r = 0; r < used; ++r)
    for (size_t e : ge) replica_params[r].push_back(r == 0 ? entries_[e].master : views_[r][e]);
  std::vector<Device> devs(devices_.begin(), devices_.begin() + static_cast<std::ptrdiff_t>(used));
  // Note [Replicated updates]: the stepped copies get their own gradients.
  std::vector<std::vector<Tensor>> replica_grads;
  if (replicated_) {
    replica_grads.assign(used, std::vector<Tensor>(ge.size()));
    for (size_t r = 1; r < used; ++r)
      for (size_t k = 0; k < ge.size(); ++k)
        if (stepped_[ge[k]]) replica_grads[r][k] = views_[r][ge[k]];
  }
  std::vector<std::vector<Tensor>> recorded = reducer_->record(devs, replica_params, replica_grads);
  for (size_t r = 0; r < used; ++r)
    for (size_t k = 0; k < ge.size(); ++k)
      for (Tensor* slot : entries_[ge[k]].slots[r]) *slot = recorded[r][k];
}

void DataParallel::drop_stale_replica_grads(size_t used) {
  for (size_t e = 0; e < num_params_; ++e) {
    if (!stepped_[e]) continue;
    const bool master_has = autograd::unfinished_grad(entries_[e].master).defined();
    // A replica this forward leaves out misses its share of the master's
    // gradient: it steps not at all, and gets the master's new value.
    for (size_t r = master_has ? used : 1; r < devices_.size(); ++r) views_[r][e].set_grad(Tensor());
  }
}

void DataParallel::restore_masters() {
  for (size_t e = 0; e < num_params_; ++e)
    for (Tensor* slot : entries_[e].slots[0]) *slot = entries_[e].master;
}

DataParallel::Split DataParallel::split_batch(const nn::Value& x) const {
  Split sp;
  sp.batch = batch_size(x, options_.dim);
  CHORUS_CHECK(sp.batch > 0, "DataParallel: the batch is empty");
  const auto used = static_cast<int64_t>(std::min<size_t>(devices_.size(), static_cast<size_t>(sp.batch)));
  // As-equal-as-possible chunks: 7 over 3 devices gives 3, 2, 2.
  int64_t pos = 0;
  for (int64_t r = 0; r < used; ++r) {
    sp.lens.push_back(sp.batch / used + (r < sp.batch % used ? 1 : 0));
    sp.starts.push_back(pos);
    pos += sp.lens.back();
  }
  return sp;
}

std::vector<nn::Value> DataParallel::run_replicas(const nn::Value& x, const Split& split,
                                                  const std::function<void(size_t, const nn::Value&)>& then) {
  const size_t used = split.lens.size();
  grad_enabled_outside_ = grad_enabled();
  // The inputs go to their replicas before the weights do: each replica's
  // copy of its chunk then runs beside the weights' broadcast instead of after
  // it (issued from this thread to each device's current stream, which the
  // replica's thread continues).
  std::vector<nn::Value> ins(used);
  for (size_t r = 0; r < used; ++r) ins[r] = scatter(x, options_.dim, split.starts[r], split.lens[r], devices_[r]);
  sync_replicas(used);
  // One replica (one device, or a batch of one) is the plain module on its
  // masters: nothing to sum. Otherwise replica 0 runs on recorded aliases of
  // the masters, which go back into its slots however the forward ends, so
  // that parameters() and the optimizer only ever see the masters.
  const bool record = used > 1 && grad_enabled_outside_;
  if (replicated_ && grad_enabled_outside_) drop_stale_replica_grads(used);
  struct Restore {
    DataParallel* dp;
    bool on;
    ~Restore() {
      if (on) dp->restore_masters();
    }
  } restore{this, record};
  if (record) record_gradient_nodes(used);
  std::vector<autograd::Edge> leaves;  // held until the replicas are done
  if (grad_enabled_outside_) leaf_edges(x, &leaves);
  std::vector<nn::Value> outs(used);
  for (auto& g : stats_groups_) g->begin(static_cast<int>(used));
  struct EndStats {
    DataParallel* dp;
    ~EndStats() {
      for (auto& g : dp->stats_groups_) g->end();
    }
  } end_stats{this};
  std::vector<std::function<void()>> tasks;
  for (size_t r = 0; r < used; ++r) {
    tasks.push_back([&, r] {
      try {
        outs[r] = replicas_[r]->forward_value(ins[r]);
      } catch (const std::exception& e) {
        // The other replicas may be waiting for this one at a SyncBatchNorm
        // layer: they fail with this replica's error rather than wait for it.
        for (auto& g : stats_groups_) g->abort("replica on " + devices_[r].str() + " failed: " + e.what());
        throw;
      }
      if (then) then(r, outs[r]);
    });
  }
  threads_->run(tasks);
  return outs;
}

nn::Value DataParallel::forward_value(const nn::Value& x) {
  std::vector<nn::Value> outs = run_replicas(x, split_batch(x), nullptr);
  if (!options_.gather_output) return nn::Value(nn::Value::List(outs.begin(), outs.end()));
  return gather(outs, options_.dim, options_.output_device.value_or(devices_[0]));
}

ReplicaLosses DataParallel::forward_loss(const nn::Value& x, const nn::Value& target, const ReplicaLossFn& loss_fn,
                                         LossReduction reduction) {
  CHORUS_CHECK(static_cast<bool>(loss_fn), "DataParallel::forward_loss: no loss function given");
  const Split split = split_batch(x);
  const int64_t target_batch = batch_size(target, options_.dim);
  CHORUS_CHECK(target_batch == split.batch, "DataParallel::forward_loss: the target's batch (", target_batch,
               " along dim ", options_.dim, ") differs from the input's (", split.batch, ")");
  const size_t used = split.lens.size();
  std::vector<nn::Value> targets(used);  // issued before the replicas start, like the inputs
  for (size_t r = 0; r < used; ++r)
    targets[r] = scatter(target, options_.dim, split.starts[r], split.lens[r], devices_[r]);
  ReplicaLosses res;
  res.losses.resize(used);
  res.dim = options_.dim;
  res.output_device = options_.output_device.value_or(devices_[0]);
  if (res.output_device.is_cuda() && used > 1) {
    if (!gather_stream_ || gather_stream_->device() != res.output_device)
      gather_stream_ = Stream::create(res.output_device);
    res.gather_stream = gather_stream_;
  }
  // A loss that is not what it must be is not weighted (and is then named
  // here, on the caller's thread, not as a replica's failure).
  auto fits = [&](const Tensor& l, size_t r) { return l.defined() && l.numel() == 1 && l.device() == devices_[r]; };
  res.outputs = run_replicas(x, split, [&](size_t r, const nn::Value& out) {
    Tensor l = loss_fn(out, targets[r]);
    if (fits(l, r) && reduction == LossReduction::Mean && used > 1)
      l = l * (static_cast<double>(split.lens[r]) / static_cast<double>(split.batch));
    res.losses[r] = std::move(l);
  });
  for (size_t r = 0; r < used; ++r) {
    const Tensor& l = res.losses[r];
    CHORUS_CHECK(l.defined() && l.numel() == 1, "DataParallel::forward_loss: the loss function must return a tensor of "
                 "one element, got ", l.defined() ? l.describe() : std::string("an undefined tensor"),
                 " from the replica on ", devices_[r].str());
    CHORUS_CHECK(fits(l, r), "DataParallel::forward_loss: the loss of the replica on ", devices_[r].str(), " is on ",
                 l.device().str(), "; compute it from the output and target it is given");
  }
  return res;
}

void ReplicaLosses::backward(bool retain_graph) const {
  CHORUS_CHECK(!losses.empty(), "ReplicaLosses::backward: no losses (use what DataParallel::forward_loss returns)");
  chorus::backward(losses, {}, retain_graph);
}

Tensor ReplicaLosses::loss() const {
  CHORUS_CHECK(!losses.empty(), "ReplicaLosses::loss: no losses (use what DataParallel::forward_loss returns)");
  Tensor total;
  for (const Tensor& l : losses) {
    Tensor here = chorus::to_device(l, output_device);
    total = total.defined() ? total + here : here;
  }
  return total;
}

nn::Value ReplicaLosses::output() const { return gather(outputs, dim, output_device); }

// Note [Losses gathered beside the backward]: the batch's loss and outputs
// are copies from every replica to the output device. Issued after the step
// on the output device's current stream (as before), their copies waited for
// the other replicas' updates and the output device's queue waited for the
// copies: the first GPU's step ended well after its own update, behind the
// second GPU's update and a loss and a logits copy (a CUPTI trace;
// docs/benchmarks.md). Issued after the forward on
// the current stream, they would make the output device's backward wait for
// the slowest replica's forward. So they go on a stream of their own, which
// waits for each replica's forward as issued so far (the copies from other
// devices wait on those devices' current streams, ops::to_device), and the
// output device's stream joins it once, at the end of the step.
namespace {
// v with every tensor detached (the gathered loss and output carry no gradient,
// even where one replica's are returned as they are).
nn::Value detached(const nn::Value& v) {
  if (v.is_tensor()) return nn::Value(v.tensor().detach());
  if (v.is_list()) {
    nn::Value::List out;
    for (const nn::Value& e : v.list()) out.push_back(detached(e));
    return nn::Value(std::move(out));
  }
  nn::Value::Map out;
  for (const auto& [k, e] : v.map()) out.emplace(k, detached(e));
  return nn::Value(std::move(out));
}
}  // namespace

ReplicaLosses::Gathered ReplicaLosses::gather_beside() const {
  CHORUS_CHECK(!losses.empty(), "ReplicaLosses::gather_beside: no losses (use what DataParallel::forward_loss returns)");
  NoGradGuard no_grad;
  Gathered g;
  g.device = output_device;
  if (!gather_stream) {  // one replica, or a CPU output device: nothing to overlap
    g.loss = loss().detach();
    g.output = detached(output());
    return g;
  }
  const Stream& side = *gather_stream;
  Event forwarded(output_device, /*timing=*/false);
  forwarded.record(Stream::current(output_device));
  side.wait(forwarded);
  {
    StreamGuard guard(side);
    g.loss = loss().detach();
    g.output = detached(output());
  }
  // What the gather read of the output device's own replica was made on its
  // current stream: not reused there before the gather stream is done.
  auto read_beside = [&](const Tensor& t) {
    if (t.defined() && t.device() == output_device)
      backend(output_device).record_use(t.storage()->data(), output_device, output_device, side.handle());
  };
  for (const Tensor& l : losses) read_beside(l);
  for (const nn::Value& o : outputs) nn::for_each_tensor(o, read_beside);
  g.done.emplace(output_device, /*timing=*/false);
  g.done->record(side);
  return g;
}

void ReplicaLosses::Gathered::join() const {
  if (!done) return;
  const Stream main = Stream::current(device);
  main.wait(*done);
  // Made on the gather stream, read on this one from now on.
  auto read_here = [&](const Tensor& t) {
    if (t.defined()) backend(device).record_use(t.storage()->data(), device, device, main.handle());
  };
  read_here(loss);
  nn::for_each_tensor(output, read_here);
}

Tensor DataParallel::forward(const Tensor& x) {
  CHORUS_CHECK(options_.gather_output, "DataParallel: forward(Tensor) needs gather_output; use forward_value()");
  return forward_value(nn::Value(x)).tensor();
}

}  // namespace chorus::parallel
