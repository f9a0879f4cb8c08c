// Communication hooks: how DistributedDataParallel turns one gradient bucket
// into its reduction over the process group (the BucketComm of the shared
// reducer, dist/reducer.h), as PyTorch's DDP communication hooks.
//  - AllReduce: the bucket itself is all-reduced in place (averaged, or summed).
//  - Bf16Compress: a float32 bucket travels as bfloat16 (half the bytes on the
//    wire), is reduced in bfloat16 and widened back into the bucket; other
//    dtypes go as they are. PyTorch's bf16_compress_hook.
//  - Noop: nothing is communicated; each rank keeps its own gradients (the
//    ranks' models drift apart). For headroom analysis only -- how fast the
//    step would be if the all-reduce cost nothing -- as PyTorch's noop_hook.
// A bucket on a device the group cannot reduce (an NCCL group reduces the
// tensors of its own GPU; a model-parallel module has buckets on others)
// travels through a copy on the group's device.
#pragma once

#include <atomic>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "chorus/dist/process_group.h"
#include "chorus/dist/reducer.h"

namespace chorus::dist {

enum class CommHook { AllReduce, Bf16Compress, Noop };
const char* comm_hook_name(CommHook hook);
// "allreduce" | "bf16" | "noop"; ValueError for anything else.
CommHook parse_comm_hook(const std::string& name);

class GroupAllReduce final : public BucketComm {
 public:
  GroupAllReduce(ProcessGroupPtr group, bool average, CommHook hook);
  Tensor reduce(std::vector<Tensor>& srcs, const std::vector<Event>& ready) override;
  void join(const Device& device) override;
  void join_quietly() override;
  // Host seconds spent in join() waiting for the collectives (the time this
  // rank waited for the others' gradients; Note [Slow ranks named]).
  double wait_seconds() const { return wait_ns_.load(std::memory_order_relaxed) * 1e-9; }

 private:
  struct InFlight {
    WorkPtr work;
    Tensor wire;  // what the collective reduces: the bucket, or its copy
    Tensor dst;   // the bucket, which receives the result at join
  };
  ProcessGroupPtr group_;
  ReduceOp op_;
  CommHook hook_;
  std::mutex mu_;
  std::vector<InFlight> in_flight_;
  std::atomic<int64_t> wait_ns_{0};
};

}  // namespace chorus::dist
