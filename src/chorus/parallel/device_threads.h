// DeviceThreads: DataParallel's replicas run concurrently, one host thread per
// device, on the shared pool (core/device_threads.h, Note [Device thread
// pool]) that the backward engine uses too. What this adds to the pool: each
// task runs under the caller's grad mode and autocast state, and an exception
// on any thread reaches the caller of run(), naming the device.
#pragma once

#include <functional>
#include <vector>

#include "chorus/core/device.h"

namespace chorus::parallel {

class DeviceThreads {
 public:
  explicit DeviceThreads(std::vector<Device> devices) : devices_(std::move(devices)) {}

  // Runs tasks[i] on a thread of device i (i < tasks.size()) under a
  // DeviceGuard and the caller's grad mode and autocast state; waits for all;
  // rethrows the first failure (in device order) as chorus::Error "replica on
  // <device> failed: <message>".
  void run(const std::vector<std::function<void()>>& tasks);

 private:
  std::vector<Device> devices_;
};

}  // namespace chorus::parallel
