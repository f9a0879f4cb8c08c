#include "chorus/data_parallel/comm_hooks.h"

#include "chorus/core/error.h"
#include "chorus/ops/copy.h"

namespace chorus::dist {

const char* comm_hook_name(CommHookKind hook) {
  switch (hook) {
    case CommHookKind::AllReduce: return "allreduce";
    case CommHookKind::Bf16Compress: return "bf16";
    case CommHookKind::Noop: return "noop";
  }
  return "?";
}

CommHookKind parse_comm_hook(const std::string& name) {
  if (name == "allreduce") return CommHookKind::AllReduce;
  if (name == "bf16") return CommHookKind::Bf16Compress;
  if (name == "noop") return CommHookKind::Noop;
  CHORUS_THROW(ValueError, "unknown communication hook '", name, "' (expected allreduce, bf16 or noop)");
}

std::shared_ptr<CommHook> make_comm_hook(CommHookKind kind, ProcessGroupPtr group, bool average) {
  switch (kind) {
    case CommHookKind::AllReduce: return std::make_shared<ProcessGroupAllReduce>(std::move(group), average);
    case CommHookKind::Bf16Compress: return std::make_shared<Bf16CompressHook>(std::move(group), average);
    case CommHookKind::Noop: return std::make_shared<NoopHook>();
  }
  CHORUS_THROW(ValueError, "unknown communication hook");
}

ProcessGroupAllReduce::ProcessGroupAllReduce(ProcessGroupPtr group, bool average)
    : group_(std::move(group)), op_(average ? ReduceOp::Avg : ReduceOp::Sum) {
  CHORUS_CHECK(group_ != nullptr, "ProcessGroupAllReduce: the process group is null");
}

Tensor ProcessGroupAllReduce::reduce(std::vector<Tensor>& srcs, const std::vector<Event>& ready) {
  CHORUS_CHECK(srcs.size() == 1, "ProcessGroupAllReduce: one buffer per bucket and process, got ", srcs.size());
  Tensor bucket = srcs[0];
  if (group_->size() == 1) return bucket;  // the average over one rank is the bucket itself
  // The copies below run on the bucket's current stream, after its writes.
  if (!ready.empty()) Stream::current(bucket.device()).wait(ready[0]);
  Tensor on_home = bucket;
  const Device home = group_->device();
  if (home.is_cuda() && on_home.device() != home) on_home = ops::to_device(on_home, home);
  Tensor w = wire(on_home);
  WorkPtr work = group_->all_reduce(w, op_);
  std::lock_guard<std::mutex> lk(mu_);
  in_flight_.push_back({std::move(work), std::move(w), bucket});
  return bucket;  // the result lands in the bucket (at join when it travelled as a copy)
}

void ProcessGroupAllReduce::join(const Device& device) {
  std::vector<InFlight> mine;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (size_t i = 0; i < in_flight_.size();) {
      if (in_flight_[i].dst.device() == device) {
        mine.push_back(std::move(in_flight_[i]));
        in_flight_.erase(in_flight_.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        ++i;
      }
    }
  }
  for (InFlight& f : mine) {
    f.work->wait();  // CUDA: orders the group device's current stream after the collective
    if (f.wire.impl() != f.dst.impl()) ops::copy_(f.dst, f.wire);
  }
}

void ProcessGroupAllReduce::join_quietly() {
  std::vector<InFlight> all;
  {
    std::lock_guard<std::mutex> lk(mu_);
    all.swap(in_flight_);
  }
  for (InFlight& f : all) {
    try {
      f.work->wait();
    } catch (const std::exception&) {
      // The failure that matters has already been reported to the caller.
    }
  }
}

Tensor Bf16CompressHook::wire(const Tensor& bucket) const {
  return bucket.dtype() == kFloat32 ? ops::to_dtype(bucket, kBFloat16) : bucket;
}

Tensor NoopHook::reduce(std::vector<Tensor>& srcs, const std::vector<Event>&) {
  CHORUS_CHECK(srcs.size() == 1, "NoopHook: one buffer per bucket and process, got ", srcs.size());
  return srcs[0];
}

}  // namespace chorus::dist
