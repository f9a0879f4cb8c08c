// DeviceThreads: one persistent host thread per device, so that each replica's
// forward (and the host-side issue of its GPU work) runs concurrently.
// An exception on any thread reaches the caller of run(), naming the device.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "chorus/core/device.h"

namespace chorus::parallel {

class DeviceThreads {
 public:
  explicit DeviceThreads(std::vector<Device> devices);
  ~DeviceThreads();
  DeviceThreads(const DeviceThreads&) = delete;
  DeviceThreads& operator=(const DeviceThreads&) = delete;

  // Runs tasks[i] on the thread of device i (i < tasks.size()) under a
  // DeviceGuard and the caller's grad mode and autocast state; waits for all;
  // rethrows the first failure as chorus::Error "replica on <device> failed:
  // <message>".
  void run(const std::vector<std::function<void()>>& tasks);

 private:
  struct Worker;
  std::vector<std::unique_ptr<Worker>> workers_;
};

}  // namespace chorus::parallel
