// Optimizer: the base of SGD and AdamW, as torch.optim.Optimizer with one
// parameter group.
//
// Design note:
//  - Parameters are held as Tensor handles (shared TensorImpl), so moving a
//    module with Module::to() after building the optimizer is seen here.
//  - Per-parameter state (momentum buffers, Adam moments) is created lazily on
//    the parameter's own device at its first update, as PyTorch does; a
//    parameter that never had a gradient has no state and is skipped.
//  - Master weights are float32: the fused kernels update float32 only, and
//    the constructor says so rather than letting a bf16 model train silently
//    in low precision.
//  - state() / load_state() speak NamedTensors, so io/ stores optimizer
//    state in safetensors like the model itself. Names:
//      "step"                   int64 [], number of step() calls
//      "lr"                     float64 [], current learning rate
//      "param.<i>.step"         int64 [], updates parameter i has received
//      "param.<i>.<buffer>"     float32, parameter i's shape (momentum_buffer,
//                               exp_avg, exp_avg_sq)
//    <i> is the position in the parameter list given to the constructor, so a
//    model rebuilt in the same order finds its state again.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "chorus/core/tensor.h"

namespace chorus::optim {

class Optimizer {
 public:
  // `name` prefixes error messages ("SGD: learning rate must be >= 0, got -0.1").
  explicit Optimizer(std::vector<Tensor> params, double lr, std::string name = "Optimizer");
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // One update of every parameter that has a gradient.
  virtual void step() = 0;
  // step() with every gradient it reads multiplied by `grad_scale` (one
  // float32 element, float64 too for CPU parameters; on any device, copied to
  // the parameters' devices on the device, with no host wait): gradient
  // clipping's min(1, max_norm / (norm + 1e-6)) from
  // clip_grad_norm_scale (optim/clip_grad.h). Undefined: step(). This
  // default scales the gradients (replicas' included) in place first, then
  // steps; AdamW folds the scale into its fused update and leaves the
  // gradients as they are (Note [Clipping in the update] in
  // optim/clip_grad.h). ValueError for a scale of another dtype or size.
  virtual void step_scaled(const Tensor& grad_scale);
  // Drops the gradients (set to none, PyTorch's default).
  void zero_grad();

  double lr() const { return lr_; }
  void set_lr(double lr);
  const std::string& name() const { return name_; }
  // The parameters given to the constructor (not their replicas).
  const std::vector<Tensor>& params() const { return user_params_; }

  // Note [Optimizer replicas]: copies of parameters on other devices that
  // every step() keeps equal to them -- DataParallel's replicas, which then
  // need no broadcast of the new weights (Note [Replicated updates] in
  // parallel/data_parallel.h). copies[j] = {i, t}: t is a copy of params()[i]
  // (same sizes and dtype, its own tensor). Each replica is updated from its
  // own .grad with its own state (momentum, moments), by the same fused kernel
  // launch as the other parameters of its device, so with the same gradient
  // it stays bit-equal to its parameter. A replica without a gradient whose
  // parameter had one gets the parameter's new value and state copied instead;
  // a replica whose parameter had none is left alone. state() and
  // load_state() speak of params() only; load_state() copies the loaded state
  // to the replicas. `after_step` runs on the host after every step() (once,
  // at the capture, for a captured step). ValueError for an index out of
  // range, a tensor that does not match its parameter, or one already here.
  void add_replicas(const std::vector<std::pair<size_t, Tensor>>& copies, std::function<void()> after_step = {});
  // How many replicas are registered.
  size_t num_replicas() const { return params_.size() - user_params_.size(); }
  // Number of step() calls so far (restored by load_state()).
  int64_t step_count() const { return step_count_; }

  // A snapshot (copies, on the parameters' devices) of the state, named as in
  // the note above.
  virtual NamedTensors state() const;
  // state()'s tensors without the copies: the live buffers, which the next
  // step() changes in place. For a caller that freezes them itself -- a
  // sharded checkpoint's device snapshot (io/sharded_writer.h), which would
  // otherwise copy state()'s copies again.
  NamedTensors live_state() const;
  // Restores a snapshot from state(); throws ValueError naming every unknown
  // key, missing companion buffer, or shape mismatch.
  virtual void load_state(const NamedTensors& state);

 protected:
  struct ParamState {
    int64_t step = 0;                      // updates this parameter has received
    std::map<std::string, Tensor> buffers;  // float32, parameter's shape, device and layout
  };

  // state() with the buffers copied, or live_state().
  NamedTensors collect_state(bool copy_buffers) const;
  // The buffer names a subclass keeps per parameter (all or none present).
  virtual std::vector<std::string> buffer_names() const = 0;

  // Note [Optimizer layouts]: the fused kernels treat parameter, gradient
  // and state as flat arrays, so all three must share one memory layout. A
  // dense parameter (contiguous, channels-last, any permutation) keeps its
  // layout -- gradient and state are brought to the same strides and updated
  // through flat views, with no copy of the parameter; a strided view
  // registered as a parameter (rare) is updated through a contiguous copy.

  // Throws ValueError unless parameter i is float32, or float64 on a CPU device.
  void check_param_dtype(size_t i, const char* verb) const;
  // Checks that `p` can be updated now (dtype, grad matching) and returns
  // its gradient in p's dtype on p's device in p's layout (see
  // flat()); undefined when p has no gradient (skip it). With `addend`: a
  // gradient with a pending part (Note [Gradient sums in the update] in
  // data_parallel/reducer.h) comes back as it is, the part in *addend, for a fused
  // kernel to add (its `addends`); without, or where the kernel could not
  // read it as it is, the part is added first.
  Tensor grad_for_update(size_t i, Tensor* addend = nullptr) const;
  // A zero-filled buffer for parameter i (lazy state creation), in its layout.
  Tensor new_buffer(size_t i) const;
  // `copies` zero-filled buffers for each of the dense parameters `params`
  // (result[c * params.size() + k]: copy c of params[k]), in their layouts,
  // all views of one storage per (device, dtype), zeroed by one fill each
  // (Note [Optimizer state in one buffer]).
  std::vector<Tensor> new_dense_buffers(const std::vector<size_t>& params, int copies) const;
  // `t` (parameter i's shape) in parameter i's layout: `t` itself when it
  // already is, else a copy (a buffer loaded from a checkpoint is contiguous).
  Tensor in_param_layout(size_t i, const Tensor& t) const;
  // What the fused kernels take for a tensor in parameter i's layout: its flat
  // view when the parameter is dense, else the (contiguous) tensor itself.
  Tensor flat(size_t i, const Tensor& t) const;
  // Runs `update(param_view)` on a flat view of parameter i (or a contiguous
  // copy, written back, when the parameter is strided), and bumps its version.
  void update_param(size_t i, const std::function<void(const Tensor&)>& update);
  // Whether parameter i is dense in memory (flat views possible).
  bool is_dense_param(size_t i) const;
  // Throws ValueError unless `grad_scale` is one float32 or float64 element.
  void check_grad_scale(const Tensor& grad_scale) const;

  // Note [Optimizer scalars on the device]: on a CUDA device the fused kernels
  // read the learning rate and AdamW's step number from a float32 tensor
  // [lr, step] on that device rather than from kernel arguments, so that a
  // captured step (Note [CUDA graphs] in core/graph_capture.h) replays with
  // the learning rate of the moment and its own step count. set_lr() rewrites
  // entry 0 (one tiny kernel per device, only when the value changes);
  // device_scalars(d, step) makes entry 1 equal `step` -- an increment on the
  // device when it is one past the last, which is what a replay repeats --
  // and returns the tensor (undefined on CPU devices; step < 0: leave it).
  // float32 holds the step count exactly up to 2^24 (16.7 million steps), and
  // the learning rate as the kernels use it (they compute in float).
  Tensor device_scalars(const Device& d, int64_t step);
  // Host bookkeeping of one step (on_each_replay: once per replay when the
  // step is captured): the updated parameters' counts and step_count().
  void count_step(std::vector<size_t> updated);
  // Whether entry i of params_ gets an update this step: it has a gradient,
  // and, for a replica, so does its parameter.
  bool will_update(size_t i) const;
  // The end of every step(), after count_step (Note [Optimizer replicas]):
  // replicas that missed the update get their parameter's value and state;
  // then the after_step callbacks.
  void finish_replicas();

  // The parameters, then their replicas (Note [Optimizer replicas]): the
  // subclasses' step() walks them all.
  std::vector<Tensor> params_;
  std::vector<ParamState> state_;
  std::vector<Tensor> user_params_;        // params_[0, user_params_.size())
  std::vector<size_t> master_of_;           // [i - user_params_.size()]: a replica's parameter
  std::vector<std::function<void()>> after_step_;
  double lr_;
  int64_t step_count_ = 0;
  std::string name_;

 private:
  struct DeviceScalars {
    Tensor t;           // float32 [lr, step]
    double lr = 0;      // what t holds once the work enqueued so far has run
    int64_t step = 0;
  };
  std::map<Device, DeviceScalars> device_scalars_;
  void write_device_lr();
};

namespace detail {
// Throws ValueError "<name>: <what> must be <rule>, got <value>" unless ok:
// one message shape for every hyper-parameter check in optim/.
void check_hyper(bool ok, const std::string& name, const char* what, const char* rule, double value);
}  // namespace detail

}  // namespace chorus::optim
