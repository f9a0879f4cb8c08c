// DataParallel: one model, several devices, one process (Torch7's
// DataParallelTable, PyTorch's nn.DataParallel).
//
// Note [DataParallel replicas]: replicas are built once, at construction; the
// wrapped module itself is the replica on the first device. Each forward:
//  1. replicas whose master parameters changed (the optimizer bumped their
//     version) copy them in — users never call syncParameters;
//  2. every tensor of the input (a tensor or nested lists/maps) is split along
//     `dim` into as-equal-as-possible chunks, one per replica (fewer replicas
//     when the batch is smaller than the device count);
//  3. each replica runs forward on its own host thread (DeviceThreads);
//  4. outputs are concatenated on the output device, or returned per replica.
// Each replica parameter enters the graph through a Broadcast node whose
// backward sends its gradient to the master parameter's device, where the
// autograd engine sums the replicas' contributions into the one .grad() the
// optimizer sees. Backward runs each replica's part on that device's thread
// (Note [Backward on many devices]).
//
// BatchNorm: each replica normalises with its own chunk's statistics; the
// running statistics of the first device's replica (the wrapped module) are the
// ones kept, and the other replicas receive them at every forward (PyTorch's
// behaviour; use SyncBatchNorm-style global statistics via DDP instead).
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "chorus/nn/module.h"
#include "chorus/parallel/device_threads.h"

namespace chorus::parallel {

struct DataParallelOptions {
  int64_t dim = 0;                       // the batch dimension of every input tensor
  std::optional<Device> output_device;   // default: the first device
  bool gather_output = true;             // false: per-replica outputs, left on their devices
};

class DataParallel : public nn::Module {
 public:
  // Throws ValueError for an empty device list, a repeated device, or a module
  // whose parameters are not all on the first device.
  DataParallel(nn::ModulePtr module, std::vector<Device> devices, DataParallelOptions options = {});

  // Single tensor in, single tensor out (gathered on the output device).
  Tensor forward(const Tensor& x) override;
  // Nested inputs; with gather_output=false the result is a list with one
  // output per replica used.
  nn::Value forward_value(const nn::Value& x) override;

  const nn::ModulePtr& module() const { return module_; }
  const std::vector<Device>& devices() const { return devices_; }
  // The replica on devices()[i] (0 is module()).
  nn::ModulePtr replica(size_t i) const { return replicas_.at(i); }

 protected:
  std::shared_ptr<nn::Module> make_empty() const override;

 private:
  struct ParamLink;  // master parameter -> its slots in each replica
  void sync_replicas(size_t used);
  int64_t batch_size(const nn::Value& x) const;
  nn::Value scatter(const nn::Value& x, int64_t start, int64_t len, const Device& d) const;
  nn::Value gather(const std::vector<nn::Value>& outs, const Device& d) const;

  nn::ModulePtr module_;
  std::vector<Device> devices_;
  DataParallelOptions options_;
  std::vector<nn::ModulePtr> replicas_;
  std::vector<std::shared_ptr<ParamLink>> links_;
  std::vector<std::vector<std::pair<Tensor*, Tensor*>>> buffer_links_;  // [replica][(master, replica)]
  std::unique_ptr<DeviceThreads> threads_;
  bool grad_enabled_outside_ = true;
};

}  // namespace chorus::parallel
