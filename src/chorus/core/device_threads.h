// DeviceThreadPool: the persistent host threads that issue work to devices,
// shared by the backward engine (one thread per device of a multi-device
// graph) and DataParallel (one thread per replica). Creating threads on every
// backward cost more than some whole GPU steps; these are made once and reused.
//
// Note [Device thread pool]: run() hands each task to an idle thread of its
// device, creating one only when none is idle. So the steady state is one
// thread per device, reused step after step (the same thread each time: its
// per-thread library handles stay warm), while runs that overlap — two user
// threads training at once, or a task that itself calls run() (a backward
// inside a replica's forward) — get threads of their own and can never wait on
// each other's queue (a fixed one-thread-per-device pool deadlocks there: run
// A holds device 0's thread waiting for device 1, run B the other way round).
#pragma once

#include <exception>
#include <functional>
#include <vector>

#include "chorus/core/device.h"

namespace chorus {

class DeviceThreadPool {
 public:
  // The process's pool (never destroyed: idle threads just end with the process).
  static DeviceThreadPool& global();

  // Runs tasks[i] on a pool thread of devices[i], under DeviceGuard(devices[i]),
  // all concurrently; returns when every task has finished. Entry i of the
  // result is the exception task i threw, or null. Task i runs with the
  // caller's current stream of devices[i] as its own. Thread-local state
  // other than the current device and stream (grad mode, autocast) is the
  // caller's to carry.
  std::vector<std::exception_ptr> run(const std::vector<Device>& devices,
                                      const std::vector<std::function<void()>>& tasks);

  // Threads created so far (tests: reuse means this stops growing).
  size_t num_threads() const;

  DeviceThreadPool();
  DeviceThreadPool(const DeviceThreadPool&) = delete;
  DeviceThreadPool& operator=(const DeviceThreadPool&) = delete;

 private:
  struct Worker;
  struct Impl;
  Impl* impl_;  // never freed, as the pool itself
};

}  // namespace chorus
