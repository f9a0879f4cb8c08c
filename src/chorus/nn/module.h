// nn::Module: named parameters, buffers and children, as PyTorch's C++ frontend.
//
// Note [State dict names]: names are dotted paths of registered children
// ("features.0.weight"); a parallel wrapper (DataParallel, DDP) registers the
// wrapped module under no extra prefix, so checkpoints do not depend on how a
// model was trained.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "chorus/core/error.h"
#include "chorus/core/tensor.h"
#include "chorus/nn/value.h"

namespace chorus::nn {

using NamedTensors = chorus::NamedTensors;  // core/tensor.h

class Module : public std::enable_shared_from_this<Module> {
 public:
  explicit Module(std::string type_name = "Module") : type_name_(std::move(type_name)) {}
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // Single-tensor forward; modules with other signatures add their own.
  virtual Tensor forward(const Tensor& x);
  Tensor operator()(const Tensor& x) { return forward(x); }
  // Nested (table) forward; the default passes a single tensor to forward().
  virtual Value forward_value(const Value& x) { return Value(forward(x.tensor())); }

  const std::string& type_name() const { return type_name_; }

  // Recursive, in registration order; shared tensors appear once (first name).
  std::vector<Tensor> parameters(bool recurse = true) const;
  NamedTensors named_parameters(bool recurse = true) const;
  NamedTensors named_buffers(bool recurse = true) const;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> named_children() const;
  std::vector<std::shared_ptr<Module>> modules();  // self first, depth first

  virtual void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }

  // Moves/casts parameters and buffers in place (the tensors keep their
  // identity, so optimizers built earlier still hold them). to(dtype) casts
  // floating parameters and buffers only.
  virtual void to(const Device& d);
  virtual void to(DType t);
  Device device() const;  // of the first parameter (cpu:0 if none)
  // Stores 4-d parameters and buffers channels-last (NHWC memory), as PyTorch's
  // model.to(memory_format=torch.channels_last); GPU convolutions then need no
  // per-call weight conversion.
  void to_channels_last();

  // Deep copy with fresh storage: the replica of DataParallel. Shared
  // parameters (and modules) stay shared inside the copy. The copy has the
  // tree as it is now, whatever built it: Note [Clones copy the tree].
  std::shared_ptr<Module> clone(const Device& device) const;
  std::shared_ptr<Module> clone() const { return clone(device()); }

  NamedTensors state_dict() const;  // parameters then buffers, by name
  // Copies values in; every key must match in name and shape (strict), and the
  // error lists what is missing, unexpected or mis-shaped.
  void load_state_dict(const NamedTensors& state);

  void zero_grad();
  int64_t num_parameters() const;
  // One line per module, as PyTorch's print(model).
  std::string str(int indent = 0) const;
  virtual std::string extra_repr() const { return ""; }

  // Registration (used by subclasses' constructors).
  Tensor& register_parameter(const std::string& name, Tensor t, bool requires_grad = true);
  Tensor& register_buffer(const std::string& name, Tensor t);
  template <typename M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> m) {
    register_child(name, m);
    return m;
  }
  void register_child(const std::string& name, std::shared_ptr<Module> m);

  // Note [Placement that holds]: `x` on the device of this module's own
  // parameters (an asynchronous, differentiable copy when it is elsewhere), so
  // a module moved with to(device) runs there whatever device its input comes
  // from -- model parallelism needs no .to() in forward, and the backward
  // runs on each device. Layers with parameters call it on their input; x
  // itself when the module has no parameters of its own.
  Tensor on_own_device(const Tensor& x) const;

  // Direct access for subclasses and wrappers.
  std::vector<std::pair<std::string, Tensor>>& own_parameters() { return params_; }
  std::vector<std::pair<std::string, Tensor>>& own_buffers() { return buffers_; }
  // The registered children, replaceable in place (dist::convert_sync_batchnorm).
  std::vector<std::pair<std::string, std::shared_ptr<Module>>>& own_children() { return children_; }

 protected:
  // Makes an empty instance of the same class for clone(); the default copies
  // via make_empty_like, which every layer implements.
  virtual std::shared_ptr<Module> make_empty() const = 0;

 private:
  void collect(const std::string& prefix, bool params, NamedTensors* out, std::vector<const TensorImpl*>* seen,
               bool recurse) const;
  struct CloneMemo;
  std::shared_ptr<Module> clone_tree(const Device& device, CloneMemo& memo) const;
  void clone_into(Module& dst, const Device& device, CloneMemo& memo) const;
  std::string type_name_;
  bool training_ = true;
  std::vector<std::pair<std::string, Tensor>> params_;
  std::vector<std::pair<std::string, Tensor>> buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
};

using ModulePtr = std::shared_ptr<Module>;

// Helper for make_empty(): most layers are copy-constructible from their options.
#define CHORUS_MODULE_CLONEABLE(Type)                                        \
 protected:                                                                 \
  std::shared_ptr<Module> make_empty() const override {                     \
    return std::make_shared<Type>(options_for_clone());                     \
  }                                                                         \
                                                                            \
 public:

// The registered child `name` of m as its concrete type M: how a model's
// modules reach one another. ValueError naming m when it has no such child;
// an internal error when the child is not an M.
template <typename M = Module>
std::shared_ptr<M> child_as(const Module& m, const std::string& name) {
  for (const auto& [n, c] : m.named_children()) {
    if (n == name) {
      auto typed = std::dynamic_pointer_cast<M>(c);
      CHORUS_ASSERT(typed != nullptr);
      return typed;
    }
  }
  CHORUS_THROW(ValueError, m.type_name(), ": has no child '", name, "'");
}

}  // namespace chorus::nn
