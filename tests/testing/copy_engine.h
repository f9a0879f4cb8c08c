// The copy-engine all-reduce (Note [Copy-engine all-reduce] in
// cuda/peer_all_reduce.h) on or off for a scope; the setting before is
// restored even when a test returns early on a failed ASSERT.
#pragma once

#include <chorus/ops/comm.h>

namespace chorus::test {

class CopyEngineAllReduce {
 public:
  explicit CopyEngineAllReduce(bool on) : before_(ops::copy_engine_all_reduce()) {
    ops::set_copy_engine_all_reduce(on);
  }
  ~CopyEngineAllReduce() { ops::set_copy_engine_all_reduce(before_); }
  CopyEngineAllReduce(const CopyEngineAllReduce&) = delete;
  CopyEngineAllReduce& operator=(const CopyEngineAllReduce&) = delete;

 private:
  bool before_;
};

}  // namespace chorus::test
