#include "chorus/dist/comm_hooks.h"

#include "chorus/core/error.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/profile.h"

#include <chrono>

namespace chorus::dist {

const char* comm_hook_name(CommHook hook) {
  switch (hook) {
    case CommHook::AllReduce: return "allreduce";
    case CommHook::Bf16Compress: return "bf16";
    case CommHook::Noop: return "noop";
  }
  return "?";
}

CommHook parse_comm_hook(const std::string& name) {
  if (name == "allreduce") return CommHook::AllReduce;
  if (name == "bf16") return CommHook::Bf16Compress;
  if (name == "noop") return CommHook::Noop;
  CHORUS_THROW(ValueError, "unknown communication hook '", name, "' (expected allreduce, bf16 or noop)");
}

GroupAllReduce::GroupAllReduce(ProcessGroupPtr group, bool average, CommHook hook)
    : group_(std::move(group)), op_(average ? ReduceOp::Avg : ReduceOp::Sum), hook_(hook) {
  CHORUS_CHECK(group_ != nullptr, "GroupAllReduce: the process group is null");
}

Tensor GroupAllReduce::reduce(std::vector<Tensor>& srcs, const std::vector<Event>& ready) {
  CHORUS_CHECK(srcs.size() == 1, "GroupAllReduce: one buffer per bucket and process, got ", srcs.size());
  Tensor bucket = srcs[0];
  if (group_->size() == 1) return bucket;  // the average over one rank is the bucket itself
  if (hook_ == CommHook::Noop) return bucket;  // headroom analysis: no communication
  // The copies below run on the bucket's current stream, after its writes.
  if (!ready.empty()) Stream::current(bucket.device()).wait(ready[0]);
  Tensor wire = bucket;
  const Device home = group_->device();
  if (home.is_cuda() && wire.device() != home) wire = ops::to_device(wire, home);
  if (hook_ == CommHook::Bf16Compress && wire.dtype() == kFloat32) wire = ops::to_dtype(wire, kBFloat16);
  WorkPtr work = group_->all_reduce(wire, op_);
  std::lock_guard<std::mutex> lk(mu_);
  in_flight_.push_back({std::move(work), std::move(wire), bucket});
  return bucket;  // the result lands in the bucket (at join when it travelled as a copy)
}

void GroupAllReduce::join(const Device& device) {
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
  // Note [Step traces]: on CPU (Gloo) this is where the host waits for the
  // other ranks' gradients.
  ops::TraceScope trace("wait_gradients");
  const auto begin = std::chrono::steady_clock::now();
  for (InFlight& f : mine) {
    f.work->wait();  // CUDA: orders the group device's current stream after the collective
    if (f.wire.impl() != f.dst.impl()) ops::copy_(f.dst, f.wire);
  }
  wait_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - begin).count(),
                     std::memory_order_relaxed);
}

void GroupAllReduce::join_quietly() {
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

}  // namespace chorus::dist
