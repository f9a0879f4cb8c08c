// Batch-norm statistics summed over several participants (the ranks of a
// process group: dist/sync_batch_norm.h), as PyTorch's SyncBatchNorm.
//
// Note [Synchronised batch norm]: each participant sums x and x^2 per channel
// over its own batch (float64), and one collective adds the packed
// [sum, sum of squares, count] over all of them; mean and biased variance
// over the global batch normalise the local x. The collective is itself an
// autograd op (its backward sums the incoming gradients the same way), and
// everything around it is ordinary differentiable ops, so the backward needs
// no formula of its own: it is exact by construction, costs one more
// collective of 2C+1 numbers, and gives each participant the gradient of its
// own weight and bias, which DDP then averages like any other. Running
// statistics move by the global mean and the unbiased global variance.
#pragma once

#include <memory>

#include "chorus/core/tensor.h"

namespace chorus::nn {

class BatchStatsReducer {
 public:
  virtual ~BatchStatsReducer() = default;
  // t (float64, contiguous) = its sum over every participant, in place.
  virtual void sum_(const Tensor& t) = 0;
};

namespace functional {
// Training-mode batch norm with statistics over every participant of
// `reducer` (Note [Synchronised batch norm]); updates the running statistics.
Tensor sync_batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                       const Tensor& bias, double momentum, double eps, BatchStatsReducer& reducer);
}  // namespace functional

}  // namespace chorus::nn
