// CommHook: how one gradient bucket's buffers become their reduction -- the
// one interface behind which every communication strategy of the gradient
// reducer (data_parallel/reducer.h) lives, one small class each, as PyTorch's DDP
// communication hooks (a hook takes a GradBucket and returns a future of the
// reduced bucket; here reduce() issues and returns the result, join() is the
// future's wait):
//  - in one process, over the replicas' devices (data_parallel/in_process_hooks.h):
//    InProcessSum, InProcessAllReduce, CopyEngineAllReduce, ExchangeInUpdate;
//  - over a process group, one replica per process (data_parallel/comm_hooks.h):
//    ProcessGroupAllReduce, Bf16CompressHook, NoopHook.
// A user's own hook derives from CommHook and goes in
// DataParallelOptions::comm_hook or DDPOptions::hook (tests/data_parallel/
// user_hook_test.cpp writes an fp16-compression one).
//
// The minimum is reduce() and join(). The rest describe what a hook can do
// beyond that for DataParallel's replicated updates, where every replica
// keeps the sum: all_reduces(), and the in-place forms sum_each() /
// exchange_each() that take the gradients where the backward wrote them
// (Note [Gradients summed where they are], Note [Gradient sums in the
// update] in data_parallel/reducer.h).
#pragma once

#include <vector>

#include "chorus/core/stream.h"
#include "chorus/core/tensor.h"

namespace chorus::dist {

class CommHook {
 public:
  virtual ~CommHook() = default;
  // srcs[r]: replica r's flat buffer of one dtype of one bucket (contiguous,
  // on its device; one replica per process: srcs has one element), readable
  // once ready[r] has passed. Issues the reduction without waiting for it and
  // returns the result, on srcs[0]'s device (it may be srcs[0] itself).
  virtual Tensor reduce(std::vector<Tensor>& srcs, const std::vector<Event>& ready) = 0;
  // Work issued to `device`'s current stream after this waits for every
  // reduce() so far, and results that travelled elsewhere are in place.
  virtual void join(const Device& device) = 0;
  // After a failure: waits for what was issued, swallowing its errors.
  virtual void join_quietly() {}

  // Whether reduce() leaves the sum in every srcs[r] (an all-reduce), so that
  // each replica can take its own copy of the gradients (Note [Replicated
  // updates] in parallel/data_parallel.h).
  virtual bool all_reduces() const { return false; }
  // Whether sum_each() is to be used instead of reduce() (an all-reducing
  // hook only): the large gradients are summed where the backward wrote them.
  virtual bool sums_each() const { return false; }
  // grads[i][r]: replica r's gradient of one of a bucket's parameters (dense,
  // on the r-th replica's device, nobody else's), readable once ready[r] has
  // passed; each is replaced by the sum over the replicas, in place, issued
  // without waiting (join() orders later work after it).
  virtual void sum_each(std::vector<std::vector<Tensor>>& grads, const std::vector<Event>& ready);
  // Whether, over `devices`, the sum is left to the optimizer: exchange_each()
  // instead of sum_each().
  virtual bool exchanges(const std::vector<Device>& devices) const {
    (void)devices;
    return false;
  }
  // As sum_each, but each grads[i][r] is left as it is and the result's
  // [i][r] is a copy of the other replica's grads[i][1 - r] on replica r's
  // device, to be its pending part (autograd/grad_finisher.h).
  virtual std::vector<std::vector<Tensor>> exchange_each(const std::vector<std::vector<Tensor>>& grads,
                                                         const std::vector<Event>& ready);
};

}  // namespace chorus::dist
