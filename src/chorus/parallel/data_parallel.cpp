#include "chorus/parallel/data_parallel.h"

#include <algorithm>
#include <cstddef>
#include <optional>
#include <unordered_map>

#include "chorus/autograd/functions.h"
#include "chorus/autograd/grad_mode.h"
#include "chorus/autograd/node.h"
#include "chorus/core/error.h"
#include "chorus/core/stream.h"
#include "chorus/ops/comm.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/factory.h"

namespace chorus::parallel {

// Note [DataParallel flat buffers] (data_parallel.h).
struct detail::FlatLayout {
  // Segments start on 128-byte boundaries, so that every view is as aligned as
  // a fresh tensor (vectorised kernels, NCCL).
  static constexpr int64_t kAlignBytes = 128;

  struct Segment {
    size_t group = 0;    // index into dtypes / numels
    int64_t offset = 0;  // elements from the start of the group's buffer
    Shape sizes, strides;
  };
  std::vector<DType> dtypes;      // [group]: one flat buffer per dtype
  std::vector<int64_t> numels;    // [group]
  std::vector<Segment> segments;  // [tensor]

  explicit FlatLayout(const std::vector<Tensor>& ts) {
    for (const Tensor& t : ts) {
      size_t g = 0;
      while (g < dtypes.size() && dtypes[g] != t.dtype()) ++g;
      if (g == dtypes.size()) {
        dtypes.push_back(t.dtype());
        numels.push_back(0);
      }
      const int64_t align = std::max<int64_t>(1, kAlignBytes / static_cast<int64_t>(dtype_size(t.dtype())));
      Segment s;
      s.group = g;
      s.offset = (numels[g] + align - 1) / align * align;
      s.sizes = t.sizes();
      // A dense layout (contiguous, channels-last, ...) is kept, so that packing
      // is a flat copy and a replica's convolution weights have the master's
      // memory format; anything else is stored contiguous.
      s.strides = ops::same_dense_layout({&t}) ? t.strides() : contiguous_strides(t.sizes());
      numels[g] = s.offset + t.numel();
      segments.push_back(std::move(s));
    }
  }

  size_t groups() const { return dtypes.size(); }

  // Tensor i's view of `flat` (the buffer of its group). The view has its own
  // version counter, as a separate tensor would: bumping one parameter's does
  // not mark its neighbours changed.
  Tensor view(const Tensor& flat, size_t i) const {
    const Segment& s = segments[i];
    Tensor v = chorus::detail::make_view(flat, s.sizes, s.strides, flat.storage_offset() + s.offset);
    v.impl()->version = std::make_shared<uint32_t>(0);
    return v;
  }

  bool matches(size_t i, const Tensor& t) const {
    return t.sizes() == segments[i].sizes && t.dtype() == dtypes[segments[i].group];
  }
};

// Note [DataParallel gradient buckets] (data_parallel.h).
struct detail::GradBuckets {
  struct Bucket {
    std::vector<size_t> ks;  // gradient entries (indices into grad_entries_), last parameters first
    FlatLayout layout;       // of their gradients, segment i for ks[i]
  };
  std::vector<Bucket> buckets;
  std::vector<size_t> bucket_of, index_in_bucket;  // [k]

  // Walks the parameters from the last to the first (the order in which a
  // backward pass usually produces their gradients), closing a bucket once it
  // holds `bucket_bytes` (0: one bucket).
  GradBuckets(const std::vector<Tensor>& masters, int64_t bucket_bytes)
      : bucket_of(masters.size()), index_in_bucket(masters.size()) {
    std::vector<size_t> ks;
    std::vector<Tensor> ms;
    int64_t bytes = 0;
    auto close = [&] {
      buckets.push_back({ks, FlatLayout(ms)});
      ks.clear();
      ms.clear();
      bytes = 0;
    };
    for (size_t k = masters.size(); k-- > 0;) {
      bucket_of[k] = buckets.size();
      index_in_bucket[k] = ks.size();
      ks.push_back(k);
      ms.push_back(masters[k]);
      bytes += masters[k].numel() * static_cast<int64_t>(dtype_size(masters[k].dtype()));
      if (bucket_bytes > 0 && bytes >= bucket_bytes && k > 0) close();
    }
    if (!ks.empty()) close();
  }
};

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

using detail::FlatLayout;
using detail::GradBuckets;

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

// What one forward's gradient nodes share (Note [DataParallel flat buffers]).
struct GradStep {
  std::shared_ptr<const GradBuckets> buckets;
  std::vector<Device> devices;  // of the replicas used, in order
  // [replica][k]: whether the replica's last backward produced a gradient for
  // gradient entry k. Each replica node writes its own bucket's entries of its
  // own row on its device's thread; the bucket's reduce node reads them after
  // the engine has handed it their outputs (the handover synchronises: Note
  // [Engine locking]), which orders the accesses.
  std::vector<std::vector<char>> got;
  // [bucket][replica]: recorded on the replica's stream once its buffers of
  // the bucket are written, by the replica node; read by the reduce node.
  std::vector<std::vector<std::optional<Event>>> ready;
  // [k]: whether any replica sent entry k; written and read on devices[0]'s
  // thread (reduce nodes, then the join node).
  std::vector<char> summed;
};

// Replica r's gradients of one bucket's parameters -> one flat buffer per
// dtype, on devices[r], for the bucket's reduce node.
class ReplicaBackward final : public autograd::Node {
 public:
  ReplicaBackward(std::shared_ptr<GradStep> step, size_t replica, size_t bucket)
      : step_(std::move(step)), replica_(replica), bucket_(bucket) {}
  std::string name() const override { return "DataParallelReplicaBackward"; }

  TensorList apply(TensorList&& grads) override {
    const GradBuckets::Bucket& bucket = step_->buckets->buckets[bucket_];
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
    // Fresh buffers from the stream-ordered allocator: nothing here aliases a
    // gradient of an earlier step that someone may still hold. Zeroed when a
    // parameter got no gradient in this replica (others may have).
    const Device dev = step_->devices[replica_];
    TensorList out(groups);
    bool any = false;
    for (size_t g = 0; g < groups; ++g) {
      if (present[g] == 0) continue;  // undefined: this replica sends nothing for this dtype
      const TensorOptions opts(layout.dtypes[g], dev);
      out[g] = present[g] == total[g] ? empty({layout.numels[g]}, opts) : zeros({layout.numels[g]}, opts);
      any = true;
    }
    // One multi-tensor copy for the gradients of the parameter's own shape and
    // dtype (Note [Multi-tensor copy] in ops/copy.h); anything else converts.
    TensorList srcs, dsts;
    for (size_t i = 0; i < bucket.ks.size(); ++i) {
      if (!got[bucket.ks[i]]) continue;
      Tensor dst = layout.view(out[layout.segments[i].group], i);
      if (grads[i].sizes() == dst.sizes() && grads[i].dtype() == dst.dtype()) {
        srcs.push_back(grads[i]);
        dsts.push_back(std::move(dst));
      } else {
        ops::copy_(dst, grads[i]);
      }
    }
    ops::copy_multi(srcs, dsts);
    if (any) {
      // The point the bucket's reduction waits for on this device (Note
      // [Overlapped collectives] in cuda/nccl.h), not the end of the backward.
      Event done(dev, /*timing=*/false);
      done.record();
      step_->ready[bucket_][replica_] = std::move(done);
    }
    return out;
  }

 private:
  std::shared_ptr<GradStep> step_;
  size_t replica_, bucket_;
};

// The replicas' flat gradient buffers of one bucket -> their sum, one buffer
// per dtype on devices[0], for the join node. Input r * groups + g is replica
// r's buffer of dtype group g. The sum is issued at once and runs while the
// replicas compute the rest of the backward; nothing waits for it here.
class ReduceBackward final : public autograd::Node {
 public:
  ReduceBackward(std::shared_ptr<GradStep> step, size_t bucket) : step_(std::move(step)), bucket_(bucket) {}
  std::string name() const override { return "DataParallelReduceBackward"; }

  TensorList apply(TensorList&& grads) override {
    const GradBuckets::Bucket& bucket = step_->buckets->buckets[bucket_];
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
      // In place into replica 0's buffer: it is fresh and nobody else holds it.
      ops::reduce_sum_after(srcs, srcs[0], ready);
      out[g] = srcs[0];
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
  std::shared_ptr<GradStep> step_;
  size_t bucket_;
};

// Every bucket's sums -> one gradient per master parameter, after joining the
// current stream of devices[0] to the reductions (one wait, once the last
// bucket is issued). Input offsets[b] + g is bucket b's sum of dtype group g.
class JoinBackward final : public autograd::Node {
 public:
  JoinBackward(std::shared_ptr<GradStep> step, std::vector<size_t> offsets)
      : step_(std::move(step)), offsets_(std::move(offsets)) {}
  std::string name() const override { return "DataParallelJoinBackward"; }

  TensorList apply(TensorList&& grads) override {
    ops::comm_join(step_->devices[0]);
    const GradBuckets& buckets = *step_->buckets;
    TensorList out(step_->summed.size());
    for (size_t k = 0; k < out.size(); ++k) {
      if (!step_->summed[k]) continue;  // no replica produced one: none, as for a plain module
      const size_t b = buckets.bucket_of[k], i = buckets.index_in_bucket[k];
      const FlatLayout& layout = buckets.buckets[b].layout;
      const size_t in = offsets_[b] + layout.segments[i].group;
      if (in < grads.size() && grads[in].defined()) {
        // Disjoint views of a fresh sum that only they refer to once this
        // node returns: each master's AccumulateGrad keeps its view as .grad
        // instead of copying it out (PyTorch's gradient_as_bucket_view).
        out[k] = layout.view(grads[in], i);
        out[k].impl()->exclusive_view = true;
      }
    }
    return out;
  }

 private:
  std::shared_ptr<GradStep> step_;
  std::vector<size_t> offsets_;  // [bucket]: its first input
};

}  // namespace

DataParallel::DataParallel(nn::ModulePtr module, std::vector<Device> devices, DataParallelOptions options)
    : nn::Module("DataParallel"), module_(std::move(module)), devices_(std::move(devices)), options_(options) {
  CHORUS_CHECK(module_ != nullptr, "DataParallel: module is null");
  CHORUS_CHECK(!devices_.empty(), "DataParallel: the device list is empty");
  CHORUS_CHECK(options_.bucket_bytes >= 0, "DataParallel: bucket_bytes must be >= 0 (0: one bucket), got ",
               options_.bucket_bytes);
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
  sync_replicas(n);  // every replica valid from the start, not only after a forward
}

DataParallel::~DataParallel() = default;

std::shared_ptr<nn::Module> DataParallel::make_empty() const {
  CHORUS_THROW(ValueError, "DataParallel cannot be cloned; clone its module() instead");
}

void DataParallel::sync_replicas(size_t used) {
  // Replicas [1, used) whose copy of any tensor of a dtype group is stale get
  // the whole group: pack the masters (one multi-tensor copy) and broadcast.
  // Per replica: a small batch leaves the idle replicas behind, and they catch
  // up when a later batch uses them again. Raw ops:: calls: never recorded.
  const size_t groups = layout_->groups();
  std::vector<char> stale(groups, 0);
  for (size_t e = 0; e < entries_.size(); ++e) {
    const Entry& entry = entries_[e];
    const Tensor& m = entry.current();
    for (size_t r = 1; r < used; ++r) {
      const Entry::Synced& s = entry.synced[r];
      if (s.counter.get() != m.impl()->version.get() || s.master_version != m.version() ||
          s.replica_version != views_[r][e].version())
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
  if (ge != grad_entries_ || !grad_buckets_) {
    std::vector<Tensor> ms;
    for (size_t e : ge) ms.push_back(entries_[e].master);
    grad_buckets_ = std::make_shared<const GradBuckets>(ms, options_.bucket_bytes);
    grad_entries_ = ge;
  }
  const GradBuckets& buckets = *grad_buckets_;
  const size_t k_count = ge.size(), n_buckets = buckets.buckets.size();

  auto step = std::make_shared<GradStep>();
  step->buckets = grad_buckets_;
  step->devices.assign(devices_.begin(), devices_.begin() + static_cast<std::ptrdiff_t>(used));
  step->got.assign(used, std::vector<char>(k_count, 0));
  step->ready.assign(n_buckets, std::vector<std::optional<Event>>(used));
  step->summed.assign(k_count, 0);

  // Urgent creation numbers (autograd/node.h): each bucket's nodes run as soon
  // as its gradients are in, so its reduction overlaps the rest of the backward.
  std::vector<size_t> offsets;
  size_t join_inputs = 0;
  for (const GradBuckets::Bucket& bucket : buckets.buckets) {
    offsets.push_back(join_inputs);
    join_inputs += bucket.layout.groups();
  }
  auto join = std::make_shared<JoinBackward>(step, offsets);
  join->seq = autograd::next_urgent_sequence_nr();
  join->device = devices_[0];
  join->num_outputs = static_cast<uint32_t>(join_inputs);
  for (size_t e : ge) {
    const Tensor& m = entries_[e].master;
    join->next.push_back(autograd::gradient_edge(m));
    join->input_meta.push_back({m.device(), m.dtype(), m.sizes()});
  }
  std::vector<std::shared_ptr<ReduceBackward>> reduces;
  for (size_t b = 0; b < n_buckets; ++b) {
    const FlatLayout& layout = buckets.buckets[b].layout;
    auto reduce = std::make_shared<ReduceBackward>(step, b);
    reduce->seq = autograd::next_urgent_sequence_nr();
    reduce->device = devices_[0];
    reduce->num_outputs = static_cast<uint32_t>(used * layout.groups());
    for (size_t g = 0; g < layout.groups(); ++g) {
      reduce->next.push_back(autograd::Edge{join, static_cast<uint32_t>(offsets[b] + g)});
      reduce->input_meta.push_back({devices_[0], layout.dtypes[g], {layout.numels[g]}});
    }
    reduces.push_back(std::move(reduce));
  }
  for (size_t r = 0; r < used; ++r) {
    std::vector<std::shared_ptr<ReplicaBackward>> nodes;
    for (size_t b = 0; b < n_buckets; ++b) {
      const FlatLayout& layout = buckets.buckets[b].layout;
      auto node = std::make_shared<ReplicaBackward>(step, r, b);
      node->seq = autograd::next_urgent_sequence_nr();
      node->device = devices_[r];  // the engine runs it on this device's thread
      node->num_outputs = static_cast<uint32_t>(buckets.buckets[b].ks.size());
      for (size_t g = 0; g < layout.groups(); ++g) {
        node->next.push_back(autograd::Edge{reduces[b], static_cast<uint32_t>(r * layout.groups() + g)});
        node->input_meta.push_back({devices_[r], layout.dtypes[g], {layout.numels[g]}});
      }
      nodes.push_back(std::move(node));
    }
    // Fresh tensors each forward (a tensor has one grad_fn): for replica 0
    // aliases of the masters, so that its gradients too take the flat path.
    for (size_t k = 0; k < k_count; ++k) {
      const Entry& entry = entries_[ge[k]];
      Tensor v = r == 0 ? entry.master.detach() : views_[r][ge[k]].detach();
      v.set_grad_fn(nodes[buckets.bucket_of[k]], static_cast<uint32_t>(buckets.index_in_bucket[k]));
      for (Tensor* slot : entry.slots[r]) *slot = v;
    }
  }
}

void DataParallel::restore_masters() {
  for (size_t e = 0; e < num_params_; ++e)
    for (Tensor* slot : entries_[e].slots[0]) *slot = entries_[e].master;
}

int64_t DataParallel::batch_size(const nn::Value& x) const {
  if (x.is_tensor()) {
    const Tensor& t = x.tensor();
    int64_t d = wrap_dim(options_.dim, t.dim(), "DataParallel (batch dim)");
    return t.size(d);
  }
  if (x.is_list()) {
    for (const auto& e : x.list()) return batch_size(e);
  } else {
    for (const auto& [k, e] : x.map()) return batch_size(e);
  }
  CHORUS_THROW(ValueError, "DataParallel: the input holds no tensor");
}

nn::Value DataParallel::scatter(const nn::Value& x, int64_t start, int64_t len, const Device& d) const {
  if (x.is_tensor()) {
    const Tensor& t = x.tensor();
    int64_t dim = wrap_dim(options_.dim, t.dim(), "DataParallel (batch dim)");
    return nn::Value(chorus::to_device(t.narrow(dim, start, len), d));
  }
  if (x.is_list()) {
    nn::Value::List out;
    for (const auto& e : x.list()) out.push_back(scatter(e, start, len, d));
    return nn::Value(std::move(out));
  }
  nn::Value::Map out;
  for (const auto& [k, e] : x.map()) out.emplace(k, scatter(e, start, len, d));
  return nn::Value(std::move(out));
}

nn::Value DataParallel::gather(const std::vector<nn::Value>& outs, const Device& d) const {
  const nn::Value& first = outs[0];
  if (first.is_tensor()) {
    TensorList parts;
    for (const auto& o : outs) parts.push_back(chorus::to_device(o.tensor(), d));
    if (parts.size() == 1) return nn::Value(parts[0]);
    int64_t dim = parts[0].dim() == 0 ? 0 : wrap_dim(options_.dim, parts[0].dim(), "DataParallel (gather)");
    if (parts[0].dim() == 0) {
      // Scalars (e.g. a loss computed inside the module) gather as a vector.
      for (auto& p : parts) p = p.unsqueeze(0);
    }
    return nn::Value(chorus::cat(parts, dim));
  }
  if (first.is_list()) {
    nn::Value::List out;
    for (size_t i = 0; i < first.list().size(); ++i) {
      std::vector<nn::Value> col;
      for (const auto& o : outs) col.push_back(o.list().at(i));
      out.push_back(gather(col, d));
    }
    return nn::Value(std::move(out));
  }
  nn::Value::Map out;
  for (const auto& [k, v] : first.map()) {
    std::vector<nn::Value> col;
    for (const auto& o : outs) col.push_back(o.map().at(k));
    out.emplace(k, gather(col, d));
  }
  return nn::Value(std::move(out));
}

nn::Value DataParallel::forward_value(const nn::Value& x) {
  const int64_t batch = batch_size(x);
  CHORUS_CHECK(batch > 0, "DataParallel: the batch is empty");
  const size_t used = std::min<size_t>(devices_.size(), static_cast<size_t>(batch));
  grad_enabled_outside_ = grad_enabled();
  sync_replicas(used);
  // One replica (one device, or a batch of one) is the plain module on its
  // masters: nothing to sum. Otherwise replica 0 runs on recorded aliases of
  // the masters, which go back into its slots however the forward ends, so
  // that parameters() and the optimizer only ever see the masters.
  const bool record = used > 1 && grad_enabled_outside_;
  struct Restore {
    DataParallel* dp;
    bool on;
    ~Restore() {
      if (on) dp->restore_masters();
    }
  } restore{this, record};
  if (record) record_gradient_nodes(used);
  // As-equal-as-possible chunks: 7 over 3 devices gives 3, 2, 2.
  std::vector<int64_t> starts(used), lens(used);
  int64_t pos = 0;
  for (size_t r = 0; r < used; ++r) {
    lens[r] = batch / static_cast<int64_t>(used) + (static_cast<int64_t>(r) < batch % static_cast<int64_t>(used) ? 1 : 0);
    starts[r] = pos;
    pos += lens[r];
  }
  std::vector<autograd::Edge> leaves;  // held until the replicas are done
  if (grad_enabled_outside_) leaf_edges(x, &leaves);
  std::vector<nn::Value> outs(used);
  std::vector<std::function<void()>> tasks;
  for (size_t r = 0; r < used; ++r) {
    tasks.push_back([&, r] {
      nn::Value in = scatter(x, starts[r], lens[r], devices_[r]);
      outs[r] = replicas_[r]->forward_value(in);
    });
  }
  threads_->run(tasks);
  if (!options_.gather_output) return nn::Value(nn::Value::List(outs.begin(), outs.end()));
  return gather(outs, options_.output_device.value_or(devices_[0]));
}

Tensor DataParallel::forward(const Tensor& x) {
  CHORUS_CHECK(options_.gather_output, "DataParallel: forward(Tensor) needs gather_output; use forward_value()");
  return forward_value(nn::Value(x)).tensor();
}

}  // namespace chorus::parallel
