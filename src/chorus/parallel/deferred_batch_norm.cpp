#include "chorus/parallel/deferred_batch_norm.h"

#include <typeinfo>

#include "chorus/autograd/grad_mode.h"
#include "chorus/core/error.h"
#include "chorus/ops/elementwise.h"
#include "chorus/ops/factory.h"

namespace chorus::parallel {

DeferredBatchNorm::DeferredBatchNorm(nn::BatchNorm2dOptions o) : nn::BatchNorm2d(o, "DeferredBatchNorm"), opts_(o) {}

Tensor DeferredBatchNorm::run(const Tensor& input, bool relu) {
  if (!is_training()) return nn::BatchNorm2d::run(input, relu);
  const Tensor x = on_own_device(input);
  CHORUS_CHECK(x.dim() == 4 || x.dim() == 2, "DeferredBatchNorm: expected [N, C, H, W], got ", x.describe());
  CHORUS_CHECK(x.size(1) == opts_.features, "DeferredBatchNorm: input has ", x.size(1), " channels, expected ",
               opts_.features);
  auto& bufs = own_buffers();
  Tensor w = opts_.affine ? own_parameters()[0].second : Tensor();
  Tensor b = opts_.affine ? own_parameters()[1].second : Tensor();
  auto f = relu ? nn::functional::batch_norm_relu : nn::functional::batch_norm;
  // A recomputed forward's micro-batch is counted already: momentum 0 leaves
  // everything as it is.
  if (recomputing()) return f(x, bufs[0].second, bufs[1].second, w, b, true, 0.0, opts_.eps, Tensor());
  // The micro-batch's own statistics normalise it. The kernel that computes
  // them also hands them over: with momentum 1 its "running" statistics are
  // exactly this micro-batch's mean and unbiased variance, so the whole-batch
  // sums cost O(channels), not another pass over the activations.
  Tensor mean = zeros({opts_.features}, {bufs[0].second.dtype(), x.device()});
  Tensor var = zeros({opts_.features}, {bufs[1].second.dtype(), x.device()});
  Tensor y = f(x, mean, var, w, b, true, 1.0, opts_.eps, Tensor());
  NoGradGuard ng;
  const int64_t n = x.numel() / x.size(1);
  Tensor s = mean.mul(static_cast<double>(n));
  // sum of squares = (n - 1) * unbiased variance + n * mean^2
  Tensor sq = mean.mul(mean).mul(static_cast<double>(n));
  if (n > 1) sq = sq.add(var.mul(static_cast<double>(n - 1)));
  if (count_ == 0) {
    sum_ = s;
    sum_sq_ = sq;
  } else {
    sum_.add_(s);
    sum_sq_.add_(sq);
  }
  count_ += n;
  return y;
}

void DeferredBatchNorm::commit() {
  if (count_ == 0) return;
  NoGradGuard ng;
  auto& bufs = own_buffers();
  const double n = static_cast<double>(count_), m = opts_.momentum;
  Tensor mean = sum_.mul(1.0 / n);
  Tensor var = sum_sq_.mul(1.0 / n).sub(mean.mul(mean));  // biased
  if (count_ > 1) var = var.mul(n / (n - 1));              // running_var is unbiased, as PyTorch's
  Tensor& rm = bufs[0].second;
  Tensor& rv = bufs[1].second;
  // At least float32 (bf16 buffers are updated in float32), and float64
  // buffers in float64: a float64 run's statistics must not be rounded.
  const DType acc = rm.dtype() == DType::Float64 ? DType::Float64 : DType::Float32;
  rm.copy_(rm.to(acc).mul(1.0 - m).add(mean.to(acc).mul(m)));
  rv.copy_(rv.to(acc).mul(1.0 - m).add(var.to(acc).mul(m)));
  ops::unary_(UnaryOp::AddScalar, bufs[2].second, 1.0);  // num_batches_tracked, on the device
  sum_ = Tensor();
  sum_sq_ = Tensor();
  count_ = 0;
}

namespace {
void convert(nn::Module& m, std::vector<std::shared_ptr<DeferredBatchNorm>>* out) {
  for (auto& [name, child] : m.own_children()) {
    if (child && typeid(*child) == typeid(nn::BatchNorm2d)) {
      auto& bn = static_cast<nn::BatchNorm2d&>(*child);
      auto d = std::make_shared<DeferredBatchNorm>(bn.options_for_clone());
      // Same tensors under the same names: optimizers and state_dict are unaffected.
      d->own_parameters() = bn.own_parameters();
      d->own_buffers() = bn.own_buffers();
      d->train(bn.is_training());
      child = d;
      out->push_back(d);
    } else if (auto d = std::dynamic_pointer_cast<DeferredBatchNorm>(child)) {
      out->push_back(d);
    } else if (child) {
      convert(*child, out);
    }
  }
}
}  // namespace

std::vector<std::shared_ptr<DeferredBatchNorm>> defer_batch_norm(nn::Module& root) {
  std::vector<std::shared_ptr<DeferredBatchNorm>> out;
  convert(root, &out);
  return out;
}

}  // namespace chorus::parallel
