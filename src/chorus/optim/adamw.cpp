#include "chorus/optim/adamw.h"

#include "chorus/core/error.h"
#include "chorus/ops/dispatch.h"

namespace chorus::optim {

AdamW::AdamW(std::vector<Tensor> params, AdamWOptions options)
    : Optimizer(std::move(params), options.lr, "AdamW"), options_(options) {
  detail::check_hyper(options.beta1 >= 0 && options.beta1 < 1, name_, "beta1", "in [0, 1)", options.beta1);
  detail::check_hyper(options.beta2 >= 0 && options.beta2 < 1, name_, "beta2", "in [0, 1)", options.beta2);
  // eps keeps the denominator away from 0 when a coordinate's gradient stays 0.
  detail::check_hyper(options.eps > 0, name_, "eps", "> 0", options.eps);
  detail::check_hyper(options.weight_decay >= 0, name_, "weight decay", ">= 0", options.weight_decay);
}

void AdamW::step() {
  const AdamWOptions& o = options_;
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor g = grad_for_update(i);
    if (!g.defined()) continue;
    ParamState& s = state_[i];
    const bool first = s.buffers.empty();
    // Note [Optimizer layouts]: state in the parameter's layout, flat views to the kernel.
    Tensor m = first ? new_buffer(i) : in_param_layout(i, s.buffers.at("exp_avg"));
    Tensor v = first ? new_buffer(i) : in_param_layout(i, s.buffers.at("exp_avg_sq"));
    if (!first) {
      s.buffers["exp_avg"] = m;
      s.buffers["exp_avg_sq"] = v;
    }
    const int64_t t = s.step + 1;
    update_param(i, [&](const Tensor& p) {
      CHORUS_KERNEL(p.device(), adamw_update, p, flat(i, g), flat(i, m), flat(i, v), lr_, o.beta1,
                    o.beta2, o.eps, o.weight_decay, t);
    });
    // State changes only after the update ran, so a failed step can be retried.
    if (first) {
      s.buffers["exp_avg"] = m;
      s.buffers["exp_avg_sq"] = v;
    }
    s.step = t;
  }
  ++step_count_;
}

}  // namespace chorus::optim
