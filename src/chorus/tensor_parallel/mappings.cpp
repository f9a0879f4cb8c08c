#include "chorus/tensor_parallel/mappings.h"

#include <mutex>

#include "chorus/autograd/grad_finisher.h"
#include "chorus/autograd/node.h"
#include "chorus/core/error.h"
#include "chorus/ops/factory.h"

namespace chorus::tp {

namespace {

int64_t wrap_dim(const Tensor& x, int64_t dim) {
  const int64_t d = dim < 0 ? dim + x.dim() : dim;
  CHORUS_CHECK(d >= 0 && d < x.dim(), "tensor parallel: dim ", dim, " is out of range for ", x.describe());
  return d;
}

// This rank's chunk along dim (a contiguous copy: the gradient it becomes is
// handed to kernels that want dense memory).
Tensor own_chunk(const Tensor& x, const ProcessGroupPtr& group, int64_t dim) {
  const int64_t d = wrap_dim(x, dim), n = group->size();
  CHORUS_CHECK(x.size(d) % n == 0, "tensor parallel: dim ", d, " of ", x.describe(), " does not divide over ", n,
               " ranks");
  const int64_t len = x.size(d) / n;
  return x.narrow(d, group->rank() * len, len).contiguous();
}

}  // namespace

void all_reduce_sum(const Tensor& x, const ProcessGroupPtr& group) {
  if (!is_parallel(group)) return;
  CHORUS_ASSERT(x.is_contiguous());
  group->all_reduce(x, dist::ReduceOp::Sum)->wait();
}

Tensor all_gather_along(const Tensor& x, const ProcessGroupPtr& group, int64_t dim) {
  if (!is_parallel(group)) return x;
  const int64_t d = wrap_dim(x, dim), n = group->size();
  // all_gather concatenates flat buffers in rank order: that is a concatenation
  // along dim 0, so move `dim` there and back.
  Tensor in = x.transpose(0, d).contiguous();
  Shape out_shape = in.sizes();
  out_shape[0] *= n;
  Tensor full = empty(out_shape, {in.dtype(), in.device()});
  group->all_gather(in, full)->wait();
  return full.transpose(0, d).contiguous();
}

Tensor reduce_scatter_along(const Tensor& x, const ProcessGroupPtr& group, int64_t dim) {
  if (!is_parallel(group)) return x;
  const int64_t d = wrap_dim(x, dim), n = group->size();
  CHORUS_CHECK(x.size(d) % n == 0, "tensor parallel: dim ", d, " of ", x.describe(), " does not divide over ", n,
               " ranks");
  Tensor in = x.transpose(0, d).contiguous();
  Shape out_shape = in.sizes();
  out_shape[0] /= n;
  Tensor out = empty(out_shape, {in.dtype(), in.device()});
  group->reduce_scatter(in, out, dist::ReduceOp::Sum)->wait();
  return out.transpose(0, d).contiguous();
}

Tensor copy_to_tp(const Tensor& x, const ProcessGroupPtr& group) {
  if (!is_parallel(group)) return x;
  return autograd::record("CopyToTensorParallelBackward", x.detach(), {x}, [group](const TensorList& g) {
    Tensor grad = g[0].contiguous().clone();
    all_reduce_sum(grad, group);
    return TensorList{grad};
  });
}

namespace {

// Note [Replicated gradients summed in the background]: the gradient of a
// replicated parameter under sequence parallelism (a LayerNorm's, a
// row-parallel bias, the positional embedding) is a small partial sum on
// each rank; there are several a block. Summing each with a blocking
// all-reduce held the compute stream behind every one of these
// latency-bound collectives. Instead the all-reduce is only issued, and the
// gradient carries a finisher that waits for it: AccumulateGrad keeps the
// gradient as .grad without reading it, and whoever reads it first -- the
// clipping's norm, the optimizer, Tensor::grad(), another micro-batch's
// accumulation -- waits (on the stream for NCCL, on the host for Gloo).
// The collective holds an alias of the gradient (not the same handle), so
// that the gradient still counts as its own sole owner and is not copied.
class CollectiveFinisher final : public autograd::GradFinisher {
 public:
  explicit CollectiveFinisher(dist::WorkPtr work) : work_(std::move(work)) {}
  // A gradient dropped unread (zero_grad after a skipped step): its memory
  // must not be handed out again while the collective may still write it.
  ~CollectiveFinisher() override {
    try {
      if (work_) work_->wait();
    } catch (...) {  // a broken group reports itself to the next collective
    }
  }
  void finish(const Tensor&) override {
    dist::WorkPtr w;
    {
      std::lock_guard<std::mutex> lock(mu_);
      w = std::move(work_);
    }
    if (w) w->wait();
  }
  bool owns_elements() const override { return true; }

 private:
  std::mutex mu_;
  dist::WorkPtr work_;
};

}  // namespace

Tensor copy_param_to_tp(const Tensor& p, const ProcessGroupPtr& group) {
  if (!is_parallel(group)) return p;
  return autograd::record("CopyToTensorParallelBackward", p.detach(), {p}, [group](const TensorList& g) {
    Tensor grad = g[0].contiguous().clone();
    // Note [Replicated gradients summed in the background]
    dist::WorkPtr work = group->all_reduce(grad.view(grad.sizes()), dist::ReduceOp::Sum);
    autograd::set_grad_finisher(grad, std::make_shared<CollectiveFinisher>(std::move(work)));
    return TensorList{grad};
  });
}

Tensor reduce_from_tp(const Tensor& x, const ProcessGroupPtr& group) {
  if (!is_parallel(group)) return x;
  Tensor sum = x.detach().contiguous().clone();
  all_reduce_sum(sum, group);
  return autograd::record("ReduceFromTensorParallelBackward", sum, {x},
                          [](const TensorList& g) { return TensorList{g[0]}; });
}

Tensor gather_from_tp(const Tensor& x, const ProcessGroupPtr& group, int64_t dim) {
  if (!is_parallel(group)) return x;
  Tensor full = all_gather_along(x.detach(), group, dim);
  return autograd::record("GatherFromTensorParallelBackward", full, {x}, [group, dim](const TensorList& g) {
    return TensorList{own_chunk(g[0], group, dim)};
  });
}

Tensor gather_from_sp(const Tensor& x, const ProcessGroupPtr& group, int64_t dim) {
  if (!is_parallel(group)) return x;
  Tensor full = all_gather_along(x.detach(), group, dim);
  return autograd::record("GatherFromSequenceParallelBackward", full, {x}, [group, dim](const TensorList& g) {
    return TensorList{reduce_scatter_along(g[0], group, dim)};
  });
}

Tensor reduce_scatter_to_sp(const Tensor& x, const ProcessGroupPtr& group, int64_t dim) {
  if (!is_parallel(group)) return x;
  Tensor part = reduce_scatter_along(x.detach(), group, dim);
  return autograd::record("ReduceScatterToSequenceParallelBackward", part, {x}, [group, dim](const TensorList& g) {
    return TensorList{all_gather_along(g[0], group, dim)};
  });
}

}  // namespace chorus::tp
