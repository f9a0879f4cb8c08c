#include "chorus/data_parallel/in_process_hooks.h"

#include "chorus/core/error.h"
#include "chorus/core/warn.h"
#include "chorus/ops/comm.h"

namespace chorus::dist {

Tensor InProcessSum::reduce(std::vector<Tensor>& srcs, const std::vector<Event>& ready) {
  // In place into replica 0's buffer: it is fresh and nobody else holds it.
  ops::reduce_sum_after(srcs, srcs[0], ready);
  return srcs[0];
}

void InProcessSum::join(const Device& device) { ops::comm_join(device); }

Tensor InProcessAllReduce::reduce(std::vector<Tensor>& srcs, const std::vector<Event>& ready) {
  // In place in every replica's buffer: each is fresh and nobody else holds it.
  ops::all_reduce_sum_after(srcs, ready);
  return srcs[0];
}

void InProcessAllReduce::join(const Device& device) { ops::comm_join(device); }

void InProcessAllReduce::sum_each(std::vector<std::vector<Tensor>>& grads, const std::vector<Event>& ready) {
  ops::all_reduce_sum_each_after(grads, ready);
}

Tensor CopyEngineAllReduce::reduce(std::vector<Tensor>& srcs, const std::vector<Event>& ready) {
  // Where the copy engines do not apply (no peer access between some pair, a
  // dtype they do not sum, not GPUs), NCCL or the fallback's adds.
  if (!ops::copy_engine_all_reduce_sum_after(srcs, ready)) ops::all_reduce_sum_after(srcs, ready);
  return srcs[0];
}

void CopyEngineAllReduce::join(const Device& device) { ops::comm_join(device); }

namespace {
std::string device_list(const std::vector<Device>& devices) {
  std::string list;
  for (const Device& d : devices) list += (list.empty() ? "" : ",") + d.str();
  return list;
}
}  // namespace

bool ExchangeInUpdate::exchanges(const std::vector<Device>& devices) const {
  const bool possible = ops::exchange_possible(devices);
  if (!possible) {
    const std::string list = device_list(devices);
    warn_once("in-update " + list, "--dp-all-reduce in-update exchanges between two devices (both CPU, or two GPUs "
                                   "with peer access both ways); over " + list + " the gradients are all-reduced");
  }
  return possible;
}

std::vector<std::vector<Tensor>> ExchangeInUpdate::exchange_each(const std::vector<std::vector<Tensor>>& grads,
                                                                 const std::vector<Event>& ready) {
  return ops::exchange_each_after(grads, ready);
}

const char* grad_sum_method_name(GradSumMethod m) {
  switch (m) {
    case GradSumMethod::Auto: return "auto";
    case GradSumMethod::Nccl: return "nccl";
    case GradSumMethod::CopyEngine: return "copy-engine";
    case GradSumMethod::InUpdate: return "in-update";
  }
  return "?";
}

GradSumMethod parse_grad_sum_method(const std::string& name, const std::string& what) {
  for (GradSumMethod m : {GradSumMethod::Auto, GradSumMethod::Nccl, GradSumMethod::CopyEngine, GradSumMethod::InUpdate})
    if (name == grad_sum_method_name(m)) return m;
  CHORUS_THROW(ValueError, what, " must be auto, nccl, copy-engine or in-update, got '", name, "'");
}

std::shared_ptr<CommHook> make_all_reduce_hook(GradSumMethod method, bool in_place,
                                               const std::vector<Device>& devices) {
  switch (method) {
    case GradSumMethod::CopyEngine:
      return std::make_shared<CopyEngineAllReduce>();  // it sums flat buffers: packed
    case GradSumMethod::InUpdate:
      if (in_place) return std::make_shared<ExchangeInUpdate>();
      warn_once("in-update packed", "--dp-all-reduce in-update needs the gradients summed where they are "
                                    "(in place, the default); with them packed they are all-reduced");
      return std::make_shared<InProcessAllReduce>(false);
    case GradSumMethod::Auto:
      // The copy engines' exchange, where it applies: two GPUs with peer access.
      if (in_place && devices.size() == 2 && devices[0].is_cuda() && devices[1].is_cuda() &&
          ops::exchange_possible(devices))
        return std::make_shared<ExchangeInUpdate>();
      return std::make_shared<InProcessAllReduce>(in_place);
    case GradSumMethod::Nccl:
      return std::make_shared<InProcessAllReduce>(in_place);
  }
  CHORUS_THROW(ValueError, "unknown gradient sum method");
}

}  // namespace chorus::dist
