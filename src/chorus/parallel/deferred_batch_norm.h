// Deferred batch norm (torchgpipe's DeferredBatchNorm): in a pipeline every
// micro-batch is normalised with its own statistics, as in any micro-batched
// training, but the running mean and variance are updated once per
// mini-batch, from the statistics of the whole mini-batch -- as if the model
// had seen it in one piece. Without it each micro-batch moves the running
// statistics by `momentum`, so a model trained with M micro-batches evaluates
// differently from the same model trained on whole batches.
//
// The pipeline converts its batch-norm layers (PipelineOptions::
// deferred_batch_norm) and calls commit() after the last micro-batch's
// forward. Parameters and buffers are the layer's own (state_dict unchanged).
#pragma once

#include <memory>

#include "chorus/nn/layers.h"

namespace chorus::parallel {

class DeferredBatchNorm : public nn::BatchNorm2d {
 public:
  explicit DeferredBatchNorm(nn::BatchNorm2dOptions o);
  // Folds the micro-batches seen since the last commit into the running
  // statistics (momentum as the layer's) and counts one batch. Nothing seen:
  // nothing changes.
  void commit();
  nn::BatchNorm2dOptions options_for_clone() const { return opts_; }
  CHORUS_MODULE_CLONEABLE(DeferredBatchNorm)

 protected:
  Tensor run(const Tensor& x, bool relu) override;

 private:
  nn::BatchNorm2dOptions opts_;
  Tensor sum_, sum_sq_;  // per channel, in the buffers' dtype, on the layer's device
  int64_t count_ = 0;    // values per channel accumulated
};

// Replaces every BatchNorm2d in `seq`'s tree (not subclasses such as
// SyncBatchNorm) by a DeferredBatchNorm holding the same tensors; returns the
// layers now deferred.
std::vector<std::shared_ptr<DeferredBatchNorm>> defer_batch_norm(nn::Module& root);

}  // namespace chorus::parallel
