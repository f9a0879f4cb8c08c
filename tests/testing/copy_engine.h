// How DataParallel sums gradients (ops::GradSumMethod: the copy-engine
// all-reduce, Note [Copy-engine all-reduce] in cuda/peer_all_reduce.h, or
// another) for a scope; the setting before is
// restored even when a test returns early on a failed ASSERT.
#pragma once

#include <chorus/ops/comm.h>

namespace chorus::test {

class CopyEngineAllReduce {
 public:
  explicit CopyEngineAllReduce(bool on)
      : CopyEngineAllReduce(on ? ops::GradSumMethod::CopyEngine : ops::GradSumMethod::Nccl) {}
  explicit CopyEngineAllReduce(ops::GradSumMethod method) : before_(ops::grad_sum_method()) {
    ops::set_grad_sum_method(method);
  }
  ~CopyEngineAllReduce() { ops::set_grad_sum_method(before_); }
  CopyEngineAllReduce(const CopyEngineAllReduce&) = delete;
  CopyEngineAllReduce& operator=(const CopyEngineAllReduce&) = delete;

 private:
  ops::GradSumMethod before_;
};

}  // namespace chorus::test
