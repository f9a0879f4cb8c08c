#include "chorus/nn/sync_stats.h"

#include "chorus/autograd/grad_mode.h"
#include "chorus/autograd/node.h"
#include "chorus/core/error.h"
#include "chorus/ops/copy.h"
#include "chorus/autograd/functions.h"
#include "chorus/ops/factory.h"

namespace chorus::nn::functional {

namespace {

// The sum over the participants, as an autograd op: the gradient of each
// participant's input is the sum of the gradients of the shared result.
Tensor summed_over_participants(const Tensor& local, BatchStatsReducer& reducer) {
  Tensor out = ops::clone(local);
  reducer.sum_(out);
  return autograd::record("SyncStatsSumBackward", out, {local}, [&reducer](const TensorList& g) -> TensorList {
    if (!g[0].defined()) return {Tensor()};
    Tensor s = ops::clone(ops::contiguous(g[0]));
    reducer.sum_(s);
    return {s};
  });
}

}  // namespace

Tensor sync_batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                       const Tensor& bias, double momentum, double eps, BatchStatsReducer& reducer) {
  CHORUS_CHECK(x.dim() == 4 || x.dim() == 2, "SyncBatchNorm: expected [N, C, H, W] or [N, C], got ", x.describe());
  const int64_t c = x.size(1);
  const Shape dims = x.dim() == 4 ? Shape{0, 2, 3} : Shape{0};
  const Shape bshape = x.dim() == 4 ? Shape{1, c, 1, 1} : Shape{1, c};
  const double local_count = static_cast<double>(x.numel() / c);
  Tensor x64 = x.to(kFloat64);
  Tensor count = chorus::full({1}, local_count, {kFloat64, x.device()});
  Tensor packed = chorus::cat({x64.sum(dims), (x64 * x64).sum(dims), count}, 0);
  Tensor total = summed_over_participants(packed, reducer);
  Tensor n = total.narrow(0, 2 * c, 1);
  Tensor mean = total.narrow(0, 0, c) / n;
  Tensor var = total.narrow(0, c, c) / n - mean * mean;  // biased, over the global batch
  Tensor invstd = (var + eps).pow(-0.5);
  const DType work = x.dtype() == kFloat64 ? kFloat64 : kFloat32;
  Tensor scale = invstd.to(work).reshape(bshape), shift = mean.to(work).reshape(bshape);
  Tensor y = (x.to(work) - shift) * scale;
  if (weight.defined()) y = y * weight.to(work).reshape(bshape) + bias.to(work).reshape(bshape);
  {
    NoGradGuard no_grad;
    Tensor m = mean.detach().to(running_mean.dtype());
    // Unbiased, computed on the device: reading the count would stall the step.
    Tensor nd = n.detach();
    Tensor v = (var.detach() * (nd / (nd - 1.0))).to(running_var.dtype());
    Tensor rm = running_mean, rv = running_var;
    rm.mul_(1 - momentum).add_(m, momentum);
    rv.mul_(1 - momentum).add_(v, momentum);
  }
  return y.dtype() == x.dtype() ? y : y.to(x.dtype());
}

}  // namespace chorus::nn::functional
