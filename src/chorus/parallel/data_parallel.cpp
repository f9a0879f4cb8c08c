#include "chorus/parallel/data_parallel.h"

#include <unordered_map>

#include "chorus/autograd/functions.h"
#include "chorus/autograd/grad_mode.h"
#include "chorus/autograd/node.h"
#include "chorus/core/error.h"
#include "chorus/ops/copy.h"

namespace chorus::parallel {

struct DataParallel::ParamLink {
  Tensor master;                           // the leaf the optimizer updates
  std::vector<uint32_t> synced_version;    // [replica] master version last copied there
  std::vector<Tensor> storage;             // [replica] persistent copy (replica 0 unused)
  std::vector<std::vector<Tensor*>> slots; // [replica] parameter slots that hold it
};

namespace {
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

  std::vector<std::vector<Tensor*>> params(devices_.size()), buffers(devices_.size());
  for (size_t r = 0; r < devices_.size(); ++r) walk(*replicas_[r], &params[r], &buffers[r]);
  std::unordered_map<const TensorImpl*, std::shared_ptr<ParamLink>> by_master;
  for (size_t i = 0; i < params[0].size(); ++i) {
    Tensor& m = *params[0][i];
    if (!m.defined()) continue;
    auto& link = by_master[m.impl()];
    if (!link) {
      link = std::make_shared<ParamLink>();
      link->master = m;
      link->storage.resize(devices_.size());
      link->synced_version.assign(devices_.size(), ~0u);
      link->slots.resize(devices_.size());
      links_.push_back(link);
    }
    for (size_t r = 1; r < devices_.size(); ++r) {
      if (!link->storage[r].defined()) link->storage[r] = params[r][i]->detach();
      link->slots[r].push_back(params[r][i]);
    }
  }
  buffer_links_.resize(devices_.size());
  for (size_t r = 1; r < devices_.size(); ++r)
    for (size_t i = 0; i < buffers[0].size(); ++i) buffer_links_[r].push_back({buffers[0][i], buffers[r][i]});
  threads_ = std::make_unique<DeviceThreads>(devices_);
}

std::shared_ptr<nn::Module> DataParallel::make_empty() const {
  CHORUS_THROW(ValueError, "DataParallel cannot be cloned; clone its module() instead");
}

void DataParallel::sync_replicas(size_t used) {
  // No NoGradGuard here: autograd::record checks grad_enabled() and would
  // silently drop the BroadcastBackward edges below (replica gradients lost).
  // The copies are raw ops:: calls, which autograd never records anyway.
  for (auto& link : links_) {
    const Tensor& m = link->master;
    for (size_t r = 1; r < used; ++r) {
      // Per replica: a small batch leaves the idle replicas behind, and they
      // must still catch up when a later batch uses them again.
      if (link->synced_version[r] != m.version()) {
        ops::copy_(link->storage[r], m);
        link->synced_version[r] = m.version();
      }
      // A fresh graph edge each forward: the replica's parameter is a view of
      // its storage whose gradient flows back to the master's device.
      Tensor view = link->storage[r].detach();
      if (m.requires_grad() && grad_enabled_outside_) {
        Device master_dev = m.device();
        view = autograd::record("BroadcastBackward", view, {m},
                                [master_dev](const TensorList& g) { return TensorList{ops::to_device(g[0], master_dev)}; });
      }
      for (Tensor* slot : link->slots[r]) *slot = view;
    }
  }
  for (size_t r = 1; r < used; ++r)
    for (auto& [master, rep] : buffer_links_[r]) ops::copy_(*rep, *master);
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
