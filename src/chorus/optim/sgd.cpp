#include "chorus/optim/sgd.h"

#include <map>
#include <utility>

#include "chorus/autograd/autocast.h"
#include "chorus/autograd/grad_mode.h"
#include "chorus/core/error.h"
#include "chorus/core/graph_capture.h"
#include "chorus/ops/copy.h"
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
  // Contiguous parameters are updated by one multi-tensor kernel per (device,
  // first step) group -- one launch for a whole model on a GPU instead of one
  // per parameter; strided ones (rare) one at a time through a copy.
  struct Group {
    TensorList params, grads, bufs, copies, addends;
    std::vector<size_t> index;
    bool any_copy = false, any_addend = false;
  };
  std::map<std::pair<Device, bool>, Group> groups;
  std::vector<std::pair<size_t, Tensor>> new_buffers;
  for (size_t i = 0; i < params_.size(); ++i) {
    // Note [Gradient sums in the update]: a dense parameter's pending part is
    // added by the fused kernel as it reads the gradient.
    Tensor addend;
    Tensor g = grad_for_update(i, is_dense_param(i) ? &addend : nullptr);
    if (!g.defined()) continue;
    ParamState& s = state_[i];
    Tensor buf;
    bool first = false;
    if (o.momentum != 0) {
      auto it = s.buffers.find("momentum_buffer");
      first = it == s.buffers.end();
      // A replay would redo the first step's "buffer = gradient" every time.
      if (first) check_not_capturing("the optimizer's first step (it creates the momentum buffers)");
      if (first) {
        buf = new_buffer(i);
        new_buffers.push_back({i, buf});
      } else {
        buf = in_param_layout(i, it->second);  // Note [Optimizer layouts]
        it->second = buf;
      }
    }
    const Tensor& p = params_[i];
    if (!is_dense_param(i)) {
      // The one-tensor kernel takes the learning rate as an argument.
      if (p.device().is_cuda()) check_not_capturing("updating a strided (non-dense) parameter");
      update_param(i, [&](const Tensor& work) {
        CHORUS_KERNEL(work.device(), sgd_update, work, g, buf, lr_, o.momentum, o.dampening,
                      o.weight_decay, o.nesterov, first);
      });
      continue;
    }
    Group& group = groups[{p.device(), first}];
    // Dense: param, grad and buffer share one layout (Note [Optimizer layouts]).
    group.params.push_back(ops::flat_view(p));
    group.grads.push_back(ops::flat_view(g));
    group.addends.push_back(addend.defined() ? ops::flat_view(addend) : addend);
    group.any_addend = group.any_addend || addend.defined();
    group.bufs.push_back(buf.defined() ? ops::flat_view(buf) : buf);
    // Note [Autocast weight copies]: the 16-bit copy the next forward will use,
    // written by the same kernel.
    const Tensor copy = p.device().is_cuda() ? autocast_copy_for_update(p) : Tensor();
    group.copies.push_back(copy.defined() ? ops::flat_view(copy) : copy);
    group.any_copy = group.any_copy || copy.defined();
    group.index.push_back(i);
  }
  {
    NoGradGuard no_grad;
    for (auto& [key, group] : groups) {
      CHORUS_KERNEL(key.first, sgd_update_multi, group.params, group.grads, group.bufs, lr_,
                    o.momentum, o.dampening, o.weight_decay, o.nesterov, key.second,
                    device_scalars(key.first, -1), group.any_copy ? group.copies : TensorList(),
                    group.any_addend ? group.addends : TensorList());
      // Saved tensors of an earlier forward now see a changed parameter.
      for (size_t i : group.index) params_[i].bump_version();
      for (size_t j = 0; j < group.index.size(); ++j)
        if (group.copies[j].defined()) autocast_copy_written(params_[group.index[j]]);
    }
  }
  // State changes only after the updates ran, so a failed step can be retried.
  for (auto& [i, buf] : new_buffers) state_[i].buffers["momentum_buffer"] = buf;
  std::vector<size_t> updated;
  for (size_t i = 0; i < params_.size(); ++i)
    if (will_update(i)) updated.push_back(i);
  count_step(std::move(updated));
  finish_replicas();
}

}  // namespace chorus::optim
