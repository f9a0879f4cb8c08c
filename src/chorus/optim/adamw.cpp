#include "chorus/optim/adamw.h"

#include <map>
#include <tuple>
#include <set>

#include "chorus/autograd/autocast.h"
#include "chorus/autograd/grad_mode.h"
#include "chorus/core/error.h"
#include "chorus/core/graph_capture.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/dispatch.h"
#include "chorus/ops/elementwise.h"

namespace chorus::optim {

AdamW::AdamW(std::vector<Tensor> params, AdamWOptions options)
    : Optimizer(std::move(params), options.lr, "AdamW"), options_(options) {
  detail::check_hyper(options.beta1 >= 0 && options.beta1 < 1, name_, "beta1", "in [0, 1)", options.beta1);
  detail::check_hyper(options.beta2 >= 0 && options.beta2 < 1, name_, "beta2", "in [0, 1)", options.beta2);
  // eps keeps the denominator away from 0 when a coordinate's gradient stays 0.
  detail::check_hyper(options.eps > 0, name_, "eps", "> 0", options.eps);
  detail::check_hyper(options.weight_decay >= 0, name_, "weight decay", ">= 0", options.weight_decay);
  CHORUS_CHECK(options.param_weight_decay.empty() || options.param_weight_decay.size() == params_.size(), name_,
               ": ", options.param_weight_decay.size(), " weight decays given for ", params_.size(), " parameters");
  for (double wd : options.param_weight_decay) detail::check_hyper(wd >= 0, name_, "weight decay", ">= 0", wd);
}

double AdamW::weight_decay_of(size_t i) const {
  // Replicas (Note [Optimizer replicas]) decay as their parameter does.
  if (options_.param_weight_decay.empty()) return options_.weight_decay;
  return options_.param_weight_decay[i < user_params_.size() ? i : master_of_[i - user_params_.size()]];
}

void AdamW::step() { update(Tensor()); }

void AdamW::step_scaled(const Tensor& grad_scale) {
  if (grad_scale.defined()) check_grad_scale(grad_scale);
  update(grad_scale);
}

void AdamW::update(const Tensor& grad_scale) {
  const AdamWOptions& o = options_;
  // The scale on each device the parameters are on: one copy per device per
  // step (a device-to-device copy in a captured step, as clipping's was).
  std::map<Device, Tensor> scale_on;
  auto scale_for = [&](const Device& d) -> Tensor {
    if (!grad_scale.defined()) return {};
    auto it = scale_on.find(d);
    if (it == scale_on.end()) {
      NoGradGuard no_grad;
      it = scale_on.emplace(d, ops::to_device(grad_scale, d)).first;
    }
    return it->second;
  };
  // As SGD: contiguous parameters are updated by one multi-tensor kernel per
  // (device, step count) group -- one launch for a whole model on a GPU;
  // strided ones one at a time through a copy.
  struct Group {
    TensorList params, grads, ms, vs, addends, copies;
    std::vector<size_t> index;
    bool any_addend = false, any_copy = false;
    // Note [Autocast weight copies]: the 16-bit copy the next forward will
    // use, written by the update's own kernel (as SGD's), not cast afresh.
    void add_copy(const Tensor& p) {
      const Tensor copy = p.device().is_cuda() ? autocast_copy_for_update(p) : Tensor();
      copies.push_back(copy.defined() ? ops::flat_view(copy) : copy);
      any_copy = any_copy || copy.defined();
    }
  };
  // One launch per (device, step count, weight decay).
  std::map<std::tuple<Device, int64_t, double>, Group> groups;
  std::vector<std::pair<size_t, std::pair<Tensor, Tensor>>> new_state;
  std::vector<std::pair<size_t, std::pair<Group*, size_t>>> fresh;  // dense, first step: (param, (group, slot))
  for (size_t i = 0; i < params_.size(); ++i) {
    // Note [Gradient sums in the update]: a dense parameter's pending part is
    // added by the fused kernel as it reads the gradient.
    Tensor addend;
    Tensor g = grad_for_update(i, is_dense_param(i) ? &addend : nullptr);
    if (!g.defined()) continue;
    ParamState& s = state_[i];
    const bool first = s.buffers.empty();
    if (first) check_not_capturing("the optimizer's first step (it creates the moment buffers)");
    const bool dense = is_dense_param(i);
    const int64_t t = s.step + 1;
    if (first && dense) {
      // Created below, all in one buffer (Note [Optimizer state in one buffer]).
      Group& group = groups[{params_[i].device(), t, weight_decay_of(i)}];
      group.params.push_back(ops::flat_view(params_[i]));
      group.grads.push_back(ops::flat_view(g));
      group.addends.push_back(addend.defined() ? ops::flat_view(addend) : addend);
      group.any_addend = group.any_addend || addend.defined();
      group.ms.emplace_back();
      group.vs.emplace_back();
      group.add_copy(params_[i]);
      group.index.push_back(i);
      fresh.push_back({i, {&group, group.ms.size() - 1}});
      continue;
    }
    // Note [Optimizer layouts]: state in the parameter's layout, flat views to the kernel.
    Tensor m = first ? new_buffer(i) : in_param_layout(i, s.buffers.at("exp_avg"));
    Tensor v = first ? new_buffer(i) : in_param_layout(i, s.buffers.at("exp_avg_sq"));
    if (first) {
      new_state.push_back({i, {m, v}});
    } else {
      s.buffers["exp_avg"] = m;
      s.buffers["exp_avg_sq"] = v;
    }
    if (!dense) {
      // The one-tensor kernel takes the learning rate and step as arguments.
      if (params_[i].device().is_cuda()) check_not_capturing("updating a strided (non-dense) parameter");
      if (grad_scale.defined()) {
        // The one-tensor kernel reads no scale: a scaled copy, the product
        // the in-place scale would have stored.
        NoGradGuard no_grad;
        g = ops::binary(BinaryOp::Mul, g, ops::to_dtype(scale_for(g.device()), g.dtype()));
      }
      update_param(i, [&](const Tensor& p) {
        CHORUS_KERNEL(p.device(), adamw_update, p, flat(i, g), flat(i, m), flat(i, v), lr_, o.beta1, o.beta2,
                      o.eps, weight_decay_of(i), t);
      });
      continue;
    }
    Group& group = groups[{params_[i].device(), t, weight_decay_of(i)}];
    group.params.push_back(ops::flat_view(params_[i]));
    group.grads.push_back(ops::flat_view(g));
    group.addends.push_back(addend.defined() ? ops::flat_view(addend) : addend);
    group.any_addend = group.any_addend || addend.defined();
    group.ms.push_back(ops::flat_view(m));
    group.vs.push_back(ops::flat_view(v));
    group.add_copy(params_[i]);
    group.index.push_back(i);
  }
  if (!fresh.empty()) {
    std::vector<size_t> idx;
    for (const auto& f : fresh) idx.push_back(f.first);
    const std::vector<Tensor> bufs = new_dense_buffers(idx, 2);
    for (size_t k = 0; k < fresh.size(); ++k) {
      const auto& [i, slot] = fresh[k];
      const Tensor& m = bufs[k];
      const Tensor& v = bufs[fresh.size() + k];
      slot.first->ms[slot.second] = ops::flat_view(m);
      slot.first->vs[slot.second] = ops::flat_view(v);
      new_state.push_back({i, {m, v}});
    }
  }
  {
    NoGradGuard no_grad;
    std::map<Device, std::pair<int64_t, Tensor>> with_scalars;
    for (auto& [key, group] : groups) {
      const auto& [device, t, wd] = key;
      // Note [Optimizer scalars on the device]: one [lr, step] per device, so
      // only the device's first step count reads it (every group's but for
      // parameters that missed updates); groups of that count share it.
      Tensor scalars;
      auto it = with_scalars.find(device);
      if (it == with_scalars.end()) {
        scalars = device_scalars(device, t);
        with_scalars[device] = {t, scalars};
      } else if (it->second.first == t) {
        scalars = it->second.second;
      } else if (device.is_cuda()) {
        check_not_capturing("AdamW parameters of one device at different step counts");
      }
      CHORUS_KERNEL(device, adamw_update_multi, group.params, group.grads, group.ms, group.vs, lr_, o.beta1,
                    o.beta2, o.eps, wd, t, scalars,
                    group.any_addend ? group.addends : TensorList(), scale_for(device),
                    group.any_copy ? group.copies : TensorList());
      for (size_t i : group.index) params_[i].bump_version();  // saved tensors see a changed parameter
      for (size_t j = 0; j < group.index.size(); ++j)
        if (group.copies[j].defined()) autocast_copy_written(params_[group.index[j]]);
    }
  }
  // State changes only after the updates ran, so a failed step can be retried.
  for (auto& [i, mv] : new_state) {
    state_[i].buffers["exp_avg"] = mv.first;
    state_[i].buffers["exp_avg_sq"] = mv.second;
  }
  std::vector<size_t> updated;
  for (size_t i = 0; i < params_.size(); ++i)
    if (will_update(i)) updated.push_back(i);
  count_step(std::move(updated));
  finish_replicas();
}

}  // namespace chorus::optim
