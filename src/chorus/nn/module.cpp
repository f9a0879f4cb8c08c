#include "chorus/nn/module.h"

#include <sstream>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>

#include "chorus/autograd/grad_mode.h"
#include "chorus/core/error.h"
#include "chorus/core/rng.h"
#include "chorus/ops/copy.h"

namespace chorus::nn {

Tensor Module::forward(const Tensor&) {
  CHORUS_THROW(ValueError, type_name_, " has no single-tensor forward()");
}

Tensor& Module::register_parameter(const std::string& name, Tensor t, bool requires_grad) {
  for (auto& p : params_)
    CHORUS_CHECK(p.first != name, type_name_, ": parameter '", name, "' registered twice");
  if (requires_grad) t.set_requires_grad(true);
  if (t.autograd_meta()) t.autograd_meta()->label = type_name_ + "." + name;  // Note [Parameters on another device]
  params_.emplace_back(name, std::move(t));
  return params_.back().second;
}

Tensor Module::on_own_device(const Tensor& x) const {
  for (const auto& [name, p] : params_)
    if (p.defined()) return x.defined() && x.device() != p.device() ? x.to(p.device()) : x;
  return x;
}

Tensor& Module::register_buffer(const std::string& name, Tensor t) {
  buffers_.emplace_back(name, std::move(t));
  return buffers_.back().second;
}

void Module::register_child(const std::string& name, std::shared_ptr<Module> m) {
  CHORUS_CHECK(m != nullptr, type_name_, ": child '", name, "' is null");
  for (auto& c : children_)
    CHORUS_CHECK(c.first != name, type_name_, ": child '", name, "' registered twice");
  children_.emplace_back(name, std::move(m));
}

void Module::collect(const std::string& prefix, bool params, NamedTensors* out,
                     std::vector<const TensorImpl*>* seen, bool recurse) const {
  for (const auto& [name, t] : params ? params_ : buffers_) {
    if (!t.defined()) continue;
    if (std::find(seen->begin(), seen->end(), t.impl()) != seen->end()) continue;
    seen->push_back(t.impl());
    out->emplace_back(prefix + name, t);
  }
  if (!recurse) return;
  // An unnamed child (a parallel wrapper's module) adds no prefix: Note [State dict names].
  for (const auto& [name, child] : children_)
    child->collect(name.empty() ? prefix : prefix + name + ".", params, out, seen, true);
}

NamedTensors Module::named_parameters(bool recurse) const {
  NamedTensors out;
  std::vector<const TensorImpl*> seen;
  collect("", true, &out, &seen, recurse);
  return out;
}

NamedTensors Module::named_buffers(bool recurse) const {
  NamedTensors out;
  std::vector<const TensorImpl*> seen;
  collect("", false, &out, &seen, recurse);
  return out;
}

std::vector<Tensor> Module::parameters(bool recurse) const {
  std::vector<Tensor> out;
  for (auto& [n, t] : named_parameters(recurse)) out.push_back(t);
  return out;
}

std::vector<std::pair<std::string, std::shared_ptr<Module>>> Module::named_children() const { return children_; }

std::vector<std::shared_ptr<Module>> Module::modules() {
  std::vector<std::shared_ptr<Module>> out{shared_from_this()};
  for (auto& [n, c] : children_) {
    auto sub = c->modules();
    out.insert(out.end(), sub.begin(), sub.end());
  }
  return out;
}

void Module::train(bool on) {
  training_ = on;
  for (auto& [n, c] : children_) c->train(on);
}

namespace {
// Replaces t's data in place (same TensorImpl) so that every holder sees it.
void move_in_place(Tensor& t, const Tensor& moved) {
  if (moved.is_same(t)) return;
  TensorImpl* i = t.impl();
  i->storage = moved.storage();
  i->sizes = moved.sizes();
  i->strides = moved.strides();
  i->offset = moved.storage_offset();
  i->dtype = moved.dtype();
}
}  // namespace

void Module::to(const Device& d) {
  check_device(d);
  NoGradGuard ng;
  for (auto* list : {&params_, &buffers_})
    for (auto& [n, t] : *list) {
      if (!t.defined()) continue;
      move_in_place(t, ops::to_device(t, d));
      Tensor g = t.grad();
      if (g.defined()) t.set_grad(ops::to_device(g, d));
    }
  for (auto& [n, c] : children_) c->to(d);
}

void Module::to_channels_last() {
  NoGradGuard ng;
  for (auto* list : {&params_, &buffers_})
    for (auto& [n, t] : *list)
      if (t.defined() && t.dim() == 4) move_in_place(t, ops::to_channels_last(t));
  for (auto& [n, c] : children_) c->to_channels_last();
}

void Module::to(DType dt) {
  NoGradGuard ng;
  for (auto* list : {&params_, &buffers_})
    for (auto& [n, t] : *list)
      if (t.defined() && is_floating(t.dtype())) {
        move_in_place(t, ops::to_dtype(t, dt));
        t.zero_grad();
      }
  for (auto& [n, c] : children_) c->to(dt);
}

Device Module::device() const {
  auto ps = named_parameters();
  if (!ps.empty()) return ps[0].second.device();
  auto bs = named_buffers();
  return bs.empty() ? cpu_device(0) : bs[0].second.device();
}

// Note [Clones copy the tree]: make_empty() builds what the constructor
// builds, but a tree may have changed since (convert_sync_batchnorm's
// SyncBatchNorm, a ReLU replaced by an Identity, layers pushed onto a
// Sequential). So the copy takes every list from the source: its parameters,
// its buffers and its children. A child the constructor built that matches the
// source's (same class, same extra_repr()) is kept and filled in place, so a
// module that holds its children in members (lin_ = register_module(...)) keeps
// working; any other child is a clone of the source's own.
struct Module::CloneMemo {
  std::unordered_map<const TensorImpl*, Tensor> tensors;
  std::unordered_map<const Module*, std::shared_ptr<Module>> modules;  // source -> copy
  std::unordered_set<const Module*> used;                               // copies placed in the tree
};

std::shared_ptr<Module> Module::clone(const Device& device) const {
  NoGradGuard ng;
  CloneMemo memo;
  return clone_tree(device, memo);
}

std::shared_ptr<Module> Module::clone_tree(const Device& device, CloneMemo& memo) const {
  if (auto it = memo.modules.find(this); it != memo.modules.end()) return it->second;  // a shared module
  // Building the empty instance runs layer constructors, which draw initial
  // weights: keep the user's random stream untouched.
  RngState saved = default_generator().state();
  std::shared_ptr<Module> copy = make_empty();
  default_generator().set_state(saved);
  CHORUS_CHECK_T(Error, copy != nullptr && typeid(*copy.get()) == typeid(*this), "clone: ", type_name_,
                 "::make_empty() built another class");
  memo.modules.emplace(this, copy);
  memo.used.insert(copy.get());
  clone_into(*copy, device, memo);
  return copy;
}

void Module::clone_into(Module& dst, const Device& device, CloneMemo& memo) const {
  dst.training_ = training_;
  dst.type_name_ = type_name_;
  auto copy_list = [&](const std::vector<std::pair<std::string, Tensor>>& from, bool is_param) {
    std::vector<std::pair<std::string, Tensor>> out;
    for (const auto& [name, s] : from) {
      if (!s.defined()) {
        out.emplace_back(name, Tensor());
        continue;
      }
      auto it = memo.tensors.find(s.impl());
      if (it == memo.tensors.end()) {  // else a shared tensor: shared in the copy too
        Tensor c = ops::clone(ops::to_device(s, device));
        if (is_param && s.requires_grad()) c.set_requires_grad(true);
        if (c.autograd_meta() && s.autograd_meta()) c.autograd_meta()->label = s.autograd_meta()->label;
        it = memo.tensors.emplace(s.impl(), c).first;
      }
      out.emplace_back(name, it->second);
    }
    return out;
  };
  dst.params_ = copy_list(params_, true);
  dst.buffers_ = copy_list(buffers_, false);
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children;
  for (size_t i = 0; i < children_.size(); ++i) {
    const auto& [name, src] = children_[i];
    std::shared_ptr<Module> built = i < dst.children_.size() && dst.children_[i].first == name
                                        ? dst.children_[i].second
                                        : nullptr;
    if (memo.modules.count(src.get())) {
      children.emplace_back(name, memo.modules.at(src.get()));
    } else if (built && !memo.used.count(built.get()) && typeid(*built.get()) == typeid(*src.get()) &&
               built->extra_repr() == src->extra_repr()) {
      memo.modules.emplace(src.get(), built);
      memo.used.insert(built.get());
      src->clone_into(*built, device, memo);
      children.emplace_back(name, built);
    } else {
      children.emplace_back(name, src->clone_tree(device, memo));
    }
  }
  dst.children_ = std::move(children);
}

NamedTensors Module::state_dict() const {
  NamedTensors out = named_parameters();
  NamedTensors b = named_buffers();
  out.insert(out.end(), b.begin(), b.end());
  return out;
}

void Module::load_state_dict(const NamedTensors& state) {
  NamedTensors mine = state_dict();
  std::vector<std::string> missing, unexpected, mismatched, wrong_dtype;
  std::unordered_map<std::string, const Tensor*> given;
  for (auto& [n, t] : state) given[n] = &t;
  for (auto& [n, t] : mine) {
    auto it = given.find(n);
    if (it == given.end()) {
      missing.push_back(n);
    } else if (it->second->sizes() != t.sizes()) {
      mismatched.push_back(n + " (checkpoint " + shape_str(it->second->sizes()) + ", model " + shape_str(t.sizes()) + ")");
    } else if (it->second->dtype() != t.dtype()) {
      // Never converted: an int32 "weight" is a damaged file, not a weight.
      wrong_dtype.push_back(n + " (checkpoint " + dtype_name(it->second->dtype()) + ", model " + dtype_name(t.dtype()) + ")");
    }
  }
  for (auto& [n, t] : state) {
    bool found = false;
    for (auto& [m, u] : mine) found = found || m == n;
    if (!found) unexpected.push_back(n);
  }
  if (!missing.empty() || !unexpected.empty() || !mismatched.empty() || !wrong_dtype.empty()) {
    std::ostringstream os;
    os << "load_state_dict: state does not match " << type_name_ << ":";
    auto list = [&](const char* what, const std::vector<std::string>& v) {
      if (v.empty()) return;
      os << " " << what << " [";
      for (size_t i = 0; i < v.size() && i < 8; ++i) os << (i ? ", " : "") << v[i];
      if (v.size() > 8) os << ", ... (" << v.size() << " in all)";
      os << "]";
    };
    list("missing", missing);
    list("unexpected", unexpected);
    list("shape mismatch", mismatched);
    list("dtype mismatch", wrong_dtype);
    CHORUS_THROW(ValueError, os.str());
  }
  NoGradGuard ng;
  for (auto& [n, t] : mine) ops::copy_(t, *given[n]);
}

void Module::zero_grad() {
  for (auto& p : parameters()) p.zero_grad();
}

int64_t Module::num_parameters() const {
  int64_t n = 0;
  for (auto& p : parameters()) n += p.numel();
  return n;
}

std::string Module::str(int indent) const {
  std::ostringstream os;
  os << type_name_ << "(" << extra_repr();
  if (!children_.empty()) {
    os << "\n";
    for (auto& [n, c] : children_)
      os << std::string(indent + 2, ' ') << "(" << n << "): " << c->str(indent + 2) << "\n";
    os << std::string(indent, ' ');
  }
  os << ")";
  return os.str();
}

}  // namespace chorus::nn
