// The communication hooks (data_parallel/comm_hook.h) of one replica per process
// (DistributedDataParallel), as PyTorch's DDP communication hooks:
//  - ProcessGroupAllReduce: the bucket itself all-reduced over the process
//    group, in place (averaged, or summed);
//  - Bf16CompressHook: a float32 bucket travels as bfloat16 (half the bytes
//    on the wire), is reduced in bfloat16 and widened back into the bucket;
//    other dtypes go as they are. PyTorch's bf16_compress_hook;
//  - NoopHook: nothing is communicated; each rank keeps its own gradients
//    (the ranks' models drift apart). For headroom analysis only -- how fast
//    the step would be if the all-reduce cost nothing -- as PyTorch's noop_hook.
// A bucket on a device the group cannot reduce (an NCCL group reduces the
// tensors of its own GPU; a model-parallel module has buckets on others)
// travels through a copy on the group's device.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "chorus/data_parallel/comm_hook.h"
#include "chorus/distributed/process_group.h"

namespace chorus::dist {

class ProcessGroupAllReduce : public CommHook {
 public:
  ProcessGroupAllReduce(ProcessGroupPtr group, bool average);
  Tensor reduce(std::vector<Tensor>& srcs, const std::vector<Event>& ready) override;
  void join(const Device& device) override;
  void join_quietly() override;

 protected:
  // What travels for `bucket` (already on the group's device): the bucket
  // itself, or a copy in another form; join() copies the result back.
  virtual Tensor wire(const Tensor& bucket) const { return bucket; }

 private:
  struct InFlight {
    WorkPtr work;
    Tensor wire;  // what the collective reduces: the bucket, or its copy
    Tensor dst;   // the bucket, which receives the result at join
  };
  ProcessGroupPtr group_;
  ReduceOp op_;
  std::mutex mu_;
  std::vector<InFlight> in_flight_;
};

class Bf16CompressHook final : public ProcessGroupAllReduce {
 public:
  using ProcessGroupAllReduce::ProcessGroupAllReduce;

 protected:
  Tensor wire(const Tensor& bucket) const override;
};

class NoopHook final : public CommHook {
 public:
  Tensor reduce(std::vector<Tensor>& srcs, const std::vector<Event>& ready) override;
  void join(const Device&) override {}
};

// DDP's built-in hooks by name (DDPOptions::comm_hook; `--comm-hook`).
enum class CommHookKind { AllReduce, Bf16Compress, Noop };
const char* comm_hook_name(CommHookKind hook);
// "allreduce" | "bf16" | "noop"; ValueError for anything else.
CommHookKind parse_comm_hook(const std::string& name);
// The hook of that kind over `group`; average: divide the sum by the size.
std::shared_ptr<CommHook> make_comm_hook(CommHookKind kind, ProcessGroupPtr group, bool average);

}  // namespace chorus::dist
