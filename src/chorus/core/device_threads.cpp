#include "chorus/core/device_threads.h"

#include "chorus/core/stream.h"

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "chorus/core/error.h"

namespace chorus {

namespace {
// One run's completion count: the caller sleeps until every task is done.
struct Latch {
  std::mutex mu;
  std::condition_variable cv;
  size_t pending = 0;
  void count_down() {
    std::lock_guard<std::mutex> lk(mu);
    if (--pending == 0) cv.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return pending == 0; });
  }
};
}  // namespace

struct DeviceThreadPool::Worker {
  Device device;
  std::mutex mu;
  std::condition_variable cv;
  std::function<void()> task;  // set while busy; the worker clears it when done
  std::thread thread;
};

struct DeviceThreadPool::Impl {
  mutable std::mutex mu;
  std::vector<std::unique_ptr<Worker>> all;
  std::map<Device, std::vector<Worker*>> idle;  // LIFO: the most recently used thread first

  Worker* acquire(const Device& d) {
    std::lock_guard<std::mutex> lk(mu);
    auto& free = idle[d];
    if (!free.empty()) {
      Worker* w = free.back();
      free.pop_back();
      return w;
    }
    auto w = std::make_unique<Worker>();
    w->device = d;
    Worker* raw = w.get();
    try {
      raw->thread = std::thread([this, raw] { loop(raw); });
    } catch (const std::system_error& e) {
      CHORUS_THROW(Error, "cannot start a host thread for ", d.str(), ": ", e.what());
    }
    all.push_back(std::move(w));
    return raw;
  }

  void loop(Worker* w) {
    DeviceGuard guard(w->device);
    for (;;) {
      std::function<void()> t;
      {
        std::unique_lock<std::mutex> lk(w->mu);
        w->cv.wait(lk, [&] { return static_cast<bool>(w->task); });
        t = std::move(w->task);
        w->task = nullptr;
      }
      // Back in the idle list before the caller is told (the task body counts
      // the latch down last), so a run() right after this one reuses it.
      t();
    }
  }

  void release(Worker* w) {
    std::lock_guard<std::mutex> lk(mu);
    idle[w->device].push_back(w);
  }
};

DeviceThreadPool& DeviceThreadPool::global() {
  static DeviceThreadPool* pool = new DeviceThreadPool();
  return *pool;
}

DeviceThreadPool::DeviceThreadPool() : impl_(new Impl()) {}

std::vector<std::exception_ptr> DeviceThreadPool::run(const std::vector<Device>& devices,
                                                      const std::vector<std::function<void()>>& tasks) {
  CHORUS_ASSERT(devices.size() == tasks.size());
  Impl* im = impl_;
  std::vector<std::exception_ptr> errors(tasks.size());
  Latch latch;
  latch.pending = tasks.size();
  std::vector<Worker*> workers;
  try {
    for (const Device& d : devices) workers.push_back(im->acquire(d));
  } catch (...) {
    for (Worker* w : workers) im->release(w);
    throw;
  }
  // Each task issues to the caller's current streams (the devices' default
  // streams unless the caller chose others), so that work on a stream the
  // caller picked -- a StreamGuard, a CUDA graph capture -- stays on it when
  // the work fans out to device threads. Every task gets the caller's stream
  // of every device of the call, not only of its own: a replica's task also
  // issues to the other devices (copies from the inputs' device, cross-device
  // gradients), and in a capture such work on a device's default stream
  // would leave the graph (cuDNN refused it: STREAM_MISMATCH; CUDA
  // invalidated the capture).
  std::vector<Stream> streams;  // one per distinct device (a device may run several tasks)
  streams.reserve(devices.size());
  for (const Device& d : devices) {
    bool seen = false;
    for (const Stream& st : streams) seen = seen || st.device() == d;
    if (!seen) streams.push_back(Stream::current(d));
  }
  for (size_t i = 0; i < tasks.size(); ++i) {
    Worker* w = workers[i];
    std::lock_guard<std::mutex> lk(w->mu);
    w->task = [&, i, w] {
      try {
        DeviceGuard g(devices[i]);
        {
          // Restored in reverse order, as nested guards would be.
          std::vector<std::unique_ptr<StreamGuard>> on_callers_streams;
          on_callers_streams.reserve(streams.size());
          for (const Stream& st : streams) on_callers_streams.push_back(std::make_unique<StreamGuard>(st));
          struct Unwind {
            std::vector<std::unique_ptr<StreamGuard>>& guards;
            ~Unwind() {
              while (!guards.empty()) guards.pop_back();
            }
          } unwind{on_callers_streams};
          tasks[i]();
        }
      } catch (...) {
        errors[i] = std::current_exception();
      }
      im->release(w);
      latch.count_down();
    };
    w->cv.notify_one();
  }
  latch.wait();
  return errors;
}

size_t DeviceThreadPool::num_threads() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->all.size();
}

}  // namespace chorus
