#include "chorus/dist/sync_batch_norm.h"

#include "chorus/core/error.h"
#include "chorus/ops/copy.h"

namespace chorus::dist {

GroupStatsReducer::GroupStatsReducer(ProcessGroupPtr group) : group_(std::move(group)) {
  CHORUS_CHECK(group_ != nullptr, "SyncBatchNorm: the process group is null");
}

void GroupStatsReducer::sum_(const Tensor& t) {
  if (group_->size() == 1) return;
  const Device home = group_->device();
  if (home.is_cuda() && t.device() != home) {
    Tensor wire = ops::to_device(t, home);
    group_->all_reduce(wire, ReduceOp::Sum)->wait();
    ops::copy_(t, wire);
  } else {
    group_->all_reduce(t, ReduceOp::Sum)->wait();
  }
}

}  // namespace chorus::dist

namespace chorus::nn {

SyncBatchNorm::SyncBatchNorm(BatchNorm2dOptions o, dist::ProcessGroupPtr group) : BatchNorm2d(o) {
  set_stats_reducer(std::make_shared<dist::GroupStatsReducer>(std::move(group)));
}

ModulePtr convert_sync_batchnorm(ModulePtr module, dist::ProcessGroupPtr group) {
  CHORUS_CHECK(module != nullptr, "convert_sync_batchnorm: module is null");
  auto reducer = std::make_shared<dist::GroupStatsReducer>(std::move(group));
  for (const ModulePtr& m : module->modules())
    if (auto* bn = dynamic_cast<BatchNorm2d*>(m.get())) bn->set_stats_reducer(reducer);
  return module;
}

}  // namespace chorus::nn
