// ProcessGroupGloo: the CPU backend of ProcessGroup (gloo_group.cpp).
#pragma once

#include <functional>
#include <memory>

#include "chorus/distributed/process_group.h"

namespace gloo {
class Context;
}

namespace chorus::dist {

#ifdef CHORUS_WITH_GLOO
class ProcessGroupGloo final : public ProcessGroup {
 public:
  // Connects to every other rank through `store` (DistError when they do not
  // all arrive within options.timeout).
  ProcessGroupGloo(int rank, int size, StorePtr store, ProcessGroupOptions options);
  ~ProcessGroupGloo() override;
  std::string backend() const override { return "gloo"; }
  Device device() const override { return Device(DeviceType::CPU, 0); }

  WorkPtr all_reduce(const Tensor& t, ReduceOp op = ReduceOp::Sum) override;
  WorkPtr broadcast(const Tensor& t, int root) override;
  WorkPtr all_gather(const Tensor& in, const Tensor& out) override;
  WorkPtr reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op = ReduceOp::Sum) override;
  WorkPtr barrier() override;
  WorkPtr send(const Tensor& t, int dst, int tag = 0) override;
  WorkPtr recv(const Tensor& t, int src, int tag = 0) override;

 private:
  struct Impl;
  class P2PWork;
  void run();
  WorkPtr post(const char* op, const Tensor& t, int peer, int tag, bool is_send);
  // `bytes`: the payload, for the flight recorder (collective_watch.h).
  // `signature`: what this rank brings to the collective (Note [Collective
  // signatures] in gloo_group.cpp), compared across ranks before it runs;
  // empty: nothing to compare (work of this rank alone).
  WorkPtr enqueue(const char* op, int64_t bytes, std::vector<int64_t> signature,
                  std::function<void(std::shared_ptr<::gloo::Context>, uint32_t)> body);
  void check_signature(const std::shared_ptr<::gloo::Context>& ctx, const char* op, uint64_t seq,
                       const std::vector<int64_t>& signature);
  [[noreturn]] void fail(const char* op, uint64_t seq, const std::string& why);
  std::unique_ptr<Impl> impl_;
};
#endif

}  // namespace chorus::dist
