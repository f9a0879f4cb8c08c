#include "chorus/optim/optimizer.h"

#include <algorithm>
#include <charconv>
#include <map>
#include <optional>
#include <set>
#include <string_view>
#include <sstream>

#include "chorus/autograd/grad_mode.h"
#include "chorus/autograd/grad_finisher.h"
#include "chorus/core/error.h"
#include "chorus/core/persistent_alloc.h"
#include "chorus/core/graph_capture.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/elementwise.h"
#include "chorus/ops/factory.h"
#include "chorus/ops/global_norm.h"

namespace chorus::optim {

namespace detail {
void check_hyper(bool ok, const std::string& name, const char* what, const char* rule, double value) {
  CHORUS_CHECK(ok, name, ": ", what, " must be ", rule, ", got ", value);
}
}  // namespace detail

Optimizer::Optimizer(std::vector<Tensor> params, double lr, std::string name)
    : params_(std::move(params)), lr_(lr), name_(std::move(name)) {
  detail::check_hyper(lr >= 0, name_, "learning rate", ">= 0", lr);
  CHORUS_CHECK(!params_.empty(), name_, ": got an empty parameter list");
  std::set<const TensorImpl*> seen;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i];
    CHORUS_CHECK(p.defined(), name_, ": parameter ", i, " is undefined");
    check_param_dtype(i, "is");
    // One tensor twice would be updated twice per step (PyTorch refuses it too).
    CHORUS_CHECK(seen.insert(p.impl()).second, name_, ": parameter ", i,
                 " appears more than once in the parameter list");
  }
  state_.resize(params_.size());
  user_params_ = params_;
}

void Optimizer::add_replicas(const std::vector<std::pair<size_t, Tensor>>& copies, std::function<void()> after_step) {
  const size_t n = user_params_.size();
  std::set<const TensorImpl*> seen;
  for (const Tensor& p : params_) seen.insert(p.impl());
  for (const auto& [i, t] : copies) {
    CHORUS_CHECK(i < n, name_, ": add_replicas: parameter ", i, " is out of range (", n, " parameters)");
    CHORUS_CHECK(t.defined(), name_, ": add_replicas: the replica of parameter ", i, " is undefined");
    const Tensor& p = user_params_[i];
    CHORUS_CHECK(t.sizes() == p.sizes() && t.dtype() == p.dtype(), name_, ": add_replicas: the replica of parameter ",
                 i, " is ", t.describe(), " but the parameter is ", p.describe());
    CHORUS_CHECK(seen.insert(t.impl()).second, name_, ": add_replicas: the replica of parameter ", i,
                 " is already a parameter or a replica of this optimizer");
  }
  for (const auto& [i, t] : copies) {
    params_.push_back(t);
    master_of_.push_back(i);
    // A replica starts where its parameter is: the same state, on its device.
    ParamState s;
    s.step = state_[i].step;
    for (const auto& [name, buf] : state_[i].buffers) s.buffers[name] = ops::clone(ops::to_device(buf, t.device()));
    state_.push_back(std::move(s));
  }
  if (after_step) after_step_.push_back(std::move(after_step));
}

namespace {
bool has_grad(const Tensor& t) { return autograd::unfinished_grad(t).defined(); }
}  // namespace

bool Optimizer::will_update(size_t i) const {
  // Whether there is a gradient, without settling a pending sum (Note
  // [Gradient sums in the update] in data_parallel/reducer.h).
  if (!has_grad(params_[i])) return false;
  return i < user_params_.size() || has_grad(params_[master_of_[i - user_params_.size()]]);
}

void Optimizer::finish_replicas() {
  NoGradGuard no_grad;
  const size_t n = user_params_.size();
  for (size_t i = n; i < params_.size(); ++i) {
    const size_t m = master_of_[i - n];
    if (has_grad(params_[i]) || !has_grad(params_[m])) continue;
    // Missed: its replica took no part in this step (a batch smaller than the
    // device count), but must equal its parameter for the next.
    check_not_capturing("a parameter replica without a gradient in the step");
    ops::copy_(params_[i], params_[m]);
    params_[i].bump_version();
    ParamState s;
    s.step = state_[m].step;
    for (const auto& [name, buf] : state_[m].buffers)
      s.buffers[name] = ops::clone(ops::to_device(buf, params_[i].device()));
    state_[i] = std::move(s);
  }
  for (const auto& f : after_step_) f();
}

void Optimizer::check_param_dtype(size_t i, const char* verb) const {
  const Tensor& p = params_[i];
  // Master weights are float32 (a bf16 model is trained through fp32 copies);
  // float64 on the CPU for double-precision reference runs.
  CHORUS_CHECK(p.dtype() == kFloat32 || (p.dtype() == kFloat64 && p.device().is_cpu()), name_, ": parameter ", i,
               " ", verb, " ", p.describe(),
               p.dtype() == kFloat64 ? "; float64 parameters are supported on CPU devices only (GPU optimizers "
                                       "update float32 master weights)"
                                     : "; optimizers update float32 master weights (float64 on the CPU) only "
                                       "(keep parameters in float32 and cast activations for mixed precision)");
}

void Optimizer::set_lr(double lr) {
  detail::check_hyper(lr >= 0, name_, "learning rate", ">= 0", lr);
  // Inside a captured step the new value would be baked into the graph.
  check_not_capturing("changing the learning rate inside the step (set it before the step instead)");
  lr_ = lr;
  write_device_lr();
}

// Note [Optimizer scalars on the device].
void Optimizer::write_device_lr() {
  NoGradGuard no_grad;
  for (auto& [d, ds] : device_scalars_) {
    if (ds.lr == lr_) continue;
    ops::fill_(ds.t.select(0, 0), lr_);
    ds.lr = lr_;
  }
}

Tensor Optimizer::device_scalars(const Device& d, int64_t step) {
  if (!d.is_cuda()) return {};
  NoGradGuard no_grad;
  auto it = device_scalars_.find(d);
  if (it == device_scalars_.end()) {
    check_not_capturing("the optimizer's first step on a device (it creates the optimizer's state)");
    const int64_t s = std::max<int64_t>(step, 0);
    Tensor t = from_vector(std::vector<float>{static_cast<float>(lr_), static_cast<float>(s)}, Shape{2},
                           TensorOptions{kFloat32, d});
    device_scalars_.emplace(d, DeviceScalars{t, lr_, s});
    return t;
  }
  DeviceScalars& ds = it->second;
  if (step >= 0 && ds.step != step) {
    if (ds.step + 1 == step) {
      ops::unary_(UnaryOp::AddScalar, ds.t.select(0, 1), 1.0);
      on_each_replay([&ds] { ++ds.step; });
    } else {
      check_not_capturing("an AdamW step count that jumps (restored or skipped parameters)");
      ops::fill_(ds.t.select(0, 1), static_cast<double>(step));
      ds.step = step;
    }
  }
  return ds.t;
}

void Optimizer::count_step(std::vector<size_t> updated) {
  on_each_replay([this, updated = std::move(updated)] {
    for (size_t i : updated) ++state_[i].step;
    ++step_count_;
  });
}

void Optimizer::check_grad_scale(const Tensor& grad_scale) const {
  CHORUS_CHECK(grad_scale.numel() == 1 && (grad_scale.dtype() == kFloat32 || grad_scale.dtype() == kFloat64), name_,
               ": the gradient scale must be one float32 or float64 element, got ", grad_scale.describe());
}

void Optimizer::step_scaled(const Tensor& grad_scale) {
  if (!grad_scale.defined()) return step();
  check_grad_scale(grad_scale);
  // Not fused: the gradients scaled in place (what clip_grad_norm_ does),
  // then the plain step.
  NoGradGuard no_grad;
  TensorList grads;
  for (size_t i = 0; i < params_.size(); ++i)
    if (will_update(i)) grads.push_back(params_[i].grad());
  ops::scale_by_(grads, grad_scale);
  step();
}

void Optimizer::zero_grad() {
  for (auto& p : params_) p.zero_grad();
}

bool Optimizer::is_dense_param(size_t i) const { return ops::same_dense_layout({&params_[i]}); }

namespace {
// An uninitialised tensor with the sizes and strides of the dense `p`.
Tensor empty_like_dense(const Tensor& p, DType dt) {
  return chorus::detail::make_view(chorus::detail::empty_tensor({p.numel()}, dt, p.device()),
                                   p.sizes(), p.strides(), 0);
}
}  // namespace

Tensor Optimizer::in_param_layout(size_t i, const Tensor& t) const {
  const Tensor& p = params_[i];
  if (!is_dense_param(i)) return ops::contiguous(t);
  if (t.strides() == p.strides() && ops::same_dense_layout({&t})) return t;
  Tensor out = empty_like_dense(p, t.dtype());
  ops::copy_(out, t);
  return out;
}

Tensor Optimizer::flat(size_t i, const Tensor& t) const {
  return is_dense_param(i) ? ops::flat_view(t) : t;
}

Tensor Optimizer::grad_for_update(size_t i, Tensor* addend) const {
  const Tensor& p = params_[i];
  if (!will_update(i)) return Tensor();
  Tensor g = autograd::unfinished_grad(p);
  // Module::to(dtype) may have cast the parameter after construction.
  check_param_dtype(i, "is now");
  CHORUS_CHECK(g.sizes() == p.sizes(), name_, ": gradient of parameter ", i, " is ", g.describe(),
               " but the parameter is ", p.describe());
  // Note [Gradient sums in the update]: the fused update adds a pending part
  // as it reads the gradient, when it reads the gradient's own memory (dtype,
  // device and layout the parameter's); any other way, it is added first.
  if (addend) {
    Tensor part = autograd::pending_part(g);
    if (part.defined() && g.dtype() == p.dtype() && g.device() == p.device() && is_dense_param(i) &&
        in_param_layout(i, g).impl() == g.impl()) {
      *addend = part;
      return g;
    }
  }
  autograd::finish_grad(g);
  return in_param_layout(i, ops::to_dtype(ops::to_device(g, p.device()), p.dtype()));
}

Tensor Optimizer::new_buffer(size_t i) const {
  const Tensor& p = params_[i];
  PersistentAllocations persistent;  // the optimizer's state: Note [Persistent allocations]
  Tensor b = is_dense_param(i) ? empty_like_dense(p, p.dtype())
                               : chorus::detail::empty_tensor(p.sizes(), p.dtype(), p.device());
  ops::fill_(b, 0.0);
  return b;
}

// Note [Optimizer state in one buffer]: the buffers a step creates for its
// dense parameters (AdamW's two moments) are views of one storage per
// (device, dtype), each starting on a 128-byte boundary, rather than an
// allocation each. The update kernels read them as before (flat views); a
// sharded checkpoint's snapshot copies the whole storage at once instead of
// thousands of pieces (Note [One buffer per snapshot] in io/sharded_writer.cpp),
// and one fill zeroes them. A buffer replaced later (load_state) is its own.
std::vector<Tensor> Optimizer::new_dense_buffers(const std::vector<size_t>& idx, int copies) const {
  constexpr int64_t kAlignBytes = 128;
  std::map<std::pair<Device, DType>, int64_t> numel;
  std::vector<int64_t> offset(idx.size() * static_cast<size_t>(copies));
  for (int c = 0; c < copies; ++c)
    for (size_t k = 0; k < idx.size(); ++k) {
      const Tensor& p = params_[idx[k]];
      CHORUS_CHECK(is_dense_param(idx[k]), name_, ": new_dense_buffers: parameter ", idx[k], " is not dense");
      int64_t& n = numel[{p.device(), p.dtype()}];
      const int64_t align = std::max<int64_t>(1, kAlignBytes / static_cast<int64_t>(dtype_size(p.dtype())));
      n = (n + align - 1) / align * align;
      offset[static_cast<size_t>(c) * idx.size() + k] = n;
      n += p.numel();
    }
  std::map<std::pair<Device, DType>, Tensor> flat;
  PersistentAllocations persistent;  // the optimizer's state: Note [Persistent allocations]
  for (const auto& [key, n] : numel) {
    Tensor f = chorus::detail::empty_tensor({n}, key.second, key.first);
    ops::fill_(f, 0.0);
    flat[key] = f;
  }
  std::vector<Tensor> out;
  out.reserve(offset.size());
  for (int c = 0; c < copies; ++c)
    for (size_t k = 0; k < idx.size(); ++k) {
      const Tensor& p = params_[idx[k]];
      out.push_back(chorus::detail::make_view(flat.at({p.device(), p.dtype()}), p.sizes(), p.strides(),
                                              offset[static_cast<size_t>(c) * idx.size() + k]));
    }
  return out;
}

void Optimizer::update_param(size_t i, const std::function<void(const Tensor&)>& update) {
  NoGradGuard no_grad;
  const Tensor& p = params_[i];
  if (is_dense_param(i)) {
    update(ops::flat_view(p));
  } else {
    // The fused kernels want dense memory; a strided parameter (rare: a view
    // registered as a parameter) is updated through a copy.
    Tensor work = ops::contiguous(p);
    update(work);
    ops::copy_(p, work);
  }
  // Saved tensors of an earlier forward now see a changed parameter.
  p.bump_version();
}

namespace {

Tensor int64_scalar(int64_t v) {
  Tensor t = chorus::detail::empty_tensor({}, kInt64, cpu_device(0));
  *t.data<int64_t>() = v;
  return t;
}

Tensor float64_scalar(double v) {
  Tensor t = chorus::detail::empty_tensor({}, kFloat64, cpu_device(0));
  *t.data<double>() = v;
  return t;
}

// Reads a one-element integer tensor, naming the key when it is not one.
int64_t read_count(const std::string& opt, const std::string& key, const Tensor& t) {
  CHORUS_CHECK(t.defined() && t.numel() == 1 && !is_floating(t.dtype()) && t.dtype() != kBool, opt,
               ": load_state: '", key, "' must be a one-element integer tensor, got ",
               t.defined() ? t.describe() : std::string("undefined"));
  double v = ops::item(t);
  CHORUS_CHECK(v >= 0, opt, ": load_state: '", key, "' must be >= 0, got ", v);
  return static_cast<int64_t>(v);
}

// Splits "param.<i>.<rest>" into (i, rest); false for any other shape.
bool parse_param_key(const std::string& key, size_t* index, std::string* rest) {
  constexpr std::string_view kPrefix = "param.";
  if (key.rfind(kPrefix, 0) != 0) return false;
  size_t dot = key.find('.', kPrefix.size());
  if (dot == std::string::npos || dot == kPrefix.size()) return false;
  const char* b = key.data() + kPrefix.size();
  const char* e = key.data() + dot;
  auto [ptr, ec] = std::from_chars(b, e, *index);
  if (ec != std::errc() || ptr != e) return false;
  *rest = key.substr(dot + 1);
  return !rest->empty();
}

}  // namespace

NamedTensors Optimizer::collect_state(bool copy_buffers) const {
  NamedTensors out;
  out.emplace_back("step", int64_scalar(step_count_));
  out.emplace_back("lr", float64_scalar(lr_));
  for (size_t i = 0; i < user_params_.size(); ++i) {
    const ParamState& s = state_[i];
    if (s.step == 0 && s.buffers.empty()) continue;  // never updated
    const std::string prefix = "param." + std::to_string(i) + ".";
    out.emplace_back(prefix + "step", int64_scalar(s.step));
    for (const auto& [name, buf] : s.buffers) out.emplace_back(prefix + name, copy_buffers ? ops::clone(buf) : buf);
  }
  return out;
}

// Copies, so that a snapshot kept across later step() calls stays a snapshot.
NamedTensors Optimizer::state() const { return collect_state(true); }

NamedTensors Optimizer::live_state() const { return collect_state(false); }

void Optimizer::load_state(const NamedTensors& state) {
  const std::vector<std::string> names = buffer_names();
  std::vector<std::string> problems;
  const size_t n = user_params_.size();
  std::vector<ParamState> loaded(n);
  std::vector<bool> has_step(n, false);
  std::optional<int64_t> step_count;
  std::optional<double> lr;
  for (const auto& [key, t] : state) {
    size_t i = 0;
    std::string rest;
    if (key == "step") {
      step_count = read_count(name_, key, t);
    } else if (key == "lr") {
      CHORUS_CHECK(t.defined() && t.numel() == 1, name_, ": load_state: 'lr' must hold one value");
      lr = ops::item(t);
      if (!(*lr >= 0)) problems.push_back("'lr' must be >= 0, got " + std::to_string(*lr));
    } else if (!parse_param_key(key, &i, &rest)) {
      problems.push_back("unexpected key '" + key + "'");
    } else if (i >= n) {
      problems.push_back("'" + key + "' names parameter " + std::to_string(i) + " but there are " +
                         std::to_string(n));
    } else if (rest == "step") {
      loaded[i].step = read_count(name_, key, t);
      has_step[i] = true;
    } else if (std::find(names.begin(), names.end(), rest) == names.end()) {
      problems.push_back("unexpected key '" + key + "' (" + name_ + " keeps no '" + rest + "')");
    } else if (!t.defined() || t.sizes() != params_[i].sizes() || !is_floating(t.dtype())) {
      problems.push_back("'" + key + "' is " + (t.defined() ? t.describe() : "undefined") +
                         " but parameter " + std::to_string(i) + " is " + params_[i].describe());
    } else {
      // On the parameter's device, contiguous, in its dtype: what the kernels update.
      loaded[i].buffers[rest] = ops::contiguous(
          ops::to_dtype(ops::clone(ops::to_device(t, params_[i].device())), params_[i].dtype()));
    }
  }
  // A snapshot always has these (state() writes them): without them it is
  // not a snapshot, and loading it would silently restart the optimizer.
  if (!step_count) problems.push_back("no 'step' (an empty or damaged snapshot?)");
  if (!lr) problems.push_back("no 'lr'");
  for (size_t i = 0; i < loaded.size(); ++i) {
    const size_t n = loaded[i].buffers.size();
    if (n == 0 && !has_step[i]) continue;
    if (!has_step[i]) problems.push_back("param." + std::to_string(i) + " has buffers but no step");
    // Buffers go together, and a parameter that was updated has all of them:
    // half of Adam's moments, or no momentum, would silently restart.
    if ((n != 0 || loaded[i].step > 0) && n != names.size())
      for (const auto& want : names)
        if (!loaded[i].buffers.count(want))
          problems.push_back("param." + std::to_string(i) + "." + want + " is missing");
  }
  if (!problems.empty()) {
    std::ostringstream os;
    for (size_t k = 0; k < problems.size() && k < 8; ++k) os << (k ? "; " : "") << problems[k];
    if (problems.size() > 8) os << "; ... (" << problems.size() << " problems in all)";
    CHORUS_THROW(ValueError, name_, ": load_state: ", os.str());
  }
  // Validated as a whole before anything changes: a failed load leaves the optimizer as it was.
  // Each replica gets its parameter's state (Note [Optimizer replicas]).
  for (size_t i = n; i < params_.size(); ++i) {
    const ParamState& from = loaded[master_of_[i - n]];
    ParamState s;
    s.step = from.step;
    for (const auto& [name, buf] : from.buffers) s.buffers[name] = ops::clone(ops::to_device(buf, params_[i].device()));
    loaded.push_back(std::move(s));
  }
  state_ = std::move(loaded);
  if (step_count) step_count_ = *step_count;
  if (lr) {
    lr_ = *lr;
    write_device_lr();
  }
}

}  // namespace chorus::optim
