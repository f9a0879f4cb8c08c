// nn::SyncBatchNorm: batch norm whose training statistics are those of the
// global batch over every rank of a process group (PyTorch's
// torch.nn.SyncBatchNorm). With it, DDP training of a batch-norm network over
// N ranks equals one process training on the N ranks' batches together.
// How: Note [Synchronised batch norm] in nn/sync_stats.h. It lives in dist/
// (nn/ cannot see process groups) but keeps the nn namespace users look for.
//
//   model = nn::convert_sync_batchnorm(model, pg);   // before wrapping in DDP
//   auto ddp = std::make_shared<dist::DistributedDataParallel>(model, pg);
//
// convert_sync_batchnorm works in place: every BatchNorm2d of the tree (the
// model's own layers, whatever holds them) takes its statistics over `pg`
// from then on, so names, parameters, buffers and checkpoints do not change;
// evaluation uses the running statistics and communicates nothing. Under
// DataParallel inside a rank, each replica normalises its own chunk.
#pragma once

#include "chorus/dist/process_group.h"
#include "chorus/nn/layers.h"

namespace chorus::dist {

// BatchStatsReducer over a process group (an all-reduce; through the group's
// device when the statistics live elsewhere).
class GroupStatsReducer final : public nn::BatchStatsReducer {
 public:
  explicit GroupStatsReducer(ProcessGroupPtr group);
  void sum_(const Tensor& t) override;

 private:
  ProcessGroupPtr group_;
};

}  // namespace chorus::dist

namespace chorus::nn {

class SyncBatchNorm : public BatchNorm2d {
 public:
  SyncBatchNorm(BatchNorm2dOptions o, dist::ProcessGroupPtr group);
};

// Makes every BatchNorm2d in `module` synchronise over `group`; returns module.
ModulePtr convert_sync_batchnorm(ModulePtr module, dist::ProcessGroupPtr group);

}  // namespace chorus::nn
