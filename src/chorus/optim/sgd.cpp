#include "chorus/optim/sgd.h"

#include "chorus/core/error.h"
#include "chorus/ops/dispatch.h"

namespace chorus::optim {

SGD::SGD(std::vector<Tensor> params, SGDOptions options)
    : Optimizer(std::move(params), options.lr, "SGD"), options_(options) {
  detail::check_hyper(options.momentum >= 0, name_, "momentum", ">= 0", options.momentum);
  detail::check_hyper(options.weight_decay >= 0, name_, "weight decay", ">= 0", options.weight_decay);
  // Nesterov's look-ahead is defined for undamped momentum only (PyTorch's rule).
  CHORUS_CHECK(!options.nesterov || (options.momentum > 0 && options.dampening == 0), name_,
               ": Nesterov momentum requires momentum > 0 and dampening 0, got momentum ",
               options.momentum, " and dampening ", options.dampening);
}

void SGD::step() {
  const SGDOptions& o = options_;
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor g = grad_for_update(i);
    if (!g.defined()) continue;
    ParamState& s = state_[i];
    Tensor buf;
    bool first = false;
    if (o.momentum != 0) {
      auto it = s.buffers.find("momentum_buffer");
      first = it == s.buffers.end();
      buf = first ? new_buffer(i) : it->second;
    }
    update_param(i, [&](const Tensor& p) {
      CHORUS_KERNEL(p.device(), sgd_update, p, g, buf, lr_, o.momentum, o.dampening, o.weight_decay,
                    o.nesterov, first);
    });
    // State changes only after the update ran, so a failed step can be retried.
    if (first) s.buffers["momentum_buffer"] = buf;
    ++s.step;
  }
  ++step_count_;
}

}  // namespace chorus::optim
