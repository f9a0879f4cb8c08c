// The communication hooks (data_parallel/comm_hook.h) of replicas inside one process
// (parallel::DataParallel), over flat buffers or gradients on the replicas'
// devices (ops/comm.h: NCCL on GPUs, copies and adds elsewhere, in replica
// order on CPU devices so results do not depend on thread timing):
//  - InProcessSum: the sum on the first device (a reduce), which then
//    broadcasts the weights it updated;
//  - InProcessAllReduce: the sum left on every device (Note [Replicated
//    updates] in parallel/data_parallel.h), the large gradients summed where
//    the backward wrote them (Note [Gradients summed where they are] in
//    data_parallel/reducer.h) or every gradient packed;
//  - CopyEngineAllReduce: the same by the GPUs' copy engines over peer
//    access (Note [Copy-engine all-reduce] in cuda/kernels/peer_all_reduce.h), on
//    packed buffers; NCCL where they do not apply;
//  - ExchangeInUpdate: over two devices, each gets the other's gradients
//    beside its own and the optimizer's update adds them (Note [Gradient sums
//    in the update] in data_parallel/reducer.h); an all-reduce over any other number.
// DataParallelOptions::grad_sum names one (make_all_reduce_hook).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "chorus/data_parallel/comm_hook.h"

namespace chorus::dist {

class InProcessSum final : public CommHook {
 public:
  Tensor reduce(std::vector<Tensor>& srcs, const std::vector<Event>& ready) override;
  void join(const Device& device) override;
};

class InProcessAllReduce : public CommHook {
 public:
  // in_place: sum_each() takes the large gradients where they are; false:
  // every gradient is packed into the bucket's flat buffers first.
  explicit InProcessAllReduce(bool in_place = true) : in_place_(in_place) {}
  Tensor reduce(std::vector<Tensor>& srcs, const std::vector<Event>& ready) override;
  void join(const Device& device) override;
  bool all_reduces() const override { return true; }
  bool sums_each() const override { return in_place_; }
  void sum_each(std::vector<std::vector<Tensor>>& grads, const std::vector<Event>& ready) override;

 private:
  bool in_place_;
};

class CopyEngineAllReduce final : public CommHook {
 public:
  Tensor reduce(std::vector<Tensor>& srcs, const std::vector<Event>& ready) override;
  void join(const Device& device) override;
  bool all_reduces() const override { return true; }
};

class ExchangeInUpdate final : public InProcessAllReduce {
 public:
  ExchangeInUpdate() : InProcessAllReduce(/*in_place=*/true) {}
  // Over two devices that can exchange (ops::exchange_possible); otherwise
  // (said once) the gradients are all-reduced in place.
  bool exchanges(const std::vector<Device>& devices) const override;
  std::vector<std::vector<Tensor>> exchange_each(const std::vector<std::vector<Tensor>>& grads,
                                                 const std::vector<Event>& ready) override;
};

// How DataParallel's replicated updates sum the replicas' gradients
// (`chorus train|bench --dp-all-reduce`):
//  - Auto (the default): ExchangeInUpdate over two GPUs with peer access,
//    else Nccl;
//  - Nccl: InProcessAllReduce (the fallback's adds on CPU devices);
//  - CopyEngine: CopyEngineAllReduce;
//  - InUpdate: ExchangeInUpdate, also on two CPU devices (a plain copy; tests).
enum class GradSumMethod { Auto, Nccl, CopyEngine, InUpdate };
const char* grad_sum_method_name(GradSumMethod method);
// "auto", "nccl", "copy-engine" or "in-update"; ValueError naming `what` else.
GradSumMethod parse_grad_sum_method(const std::string& name, const std::string& what);

// The all-reducing hook for `method` over the replicas' `devices`; in_place:
// whether large gradients are summed where they are (InUpdate needs it: with
// packed gradients it all-reduces, and says so once).
std::shared_ptr<CommHook> make_all_reduce_hook(GradSumMethod method, bool in_place, const std::vector<Device>& devices);

}  // namespace chorus::dist
