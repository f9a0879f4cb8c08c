#include "chorus/parallel/device_threads.h"

#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

#include "chorus/autograd/autocast.h"
#include "chorus/autograd/grad_mode.h"
#include "chorus/core/error.h"

namespace chorus::parallel {

struct DeviceThreads::Worker {
  Device device;
  std::mutex mu;
  std::condition_variable cv;
  std::function<void()> task;
  bool has_task = false, done = false, stop = false;
  std::exception_ptr error;
  std::thread thread;

  explicit Worker(Device d) : device(d) {
    thread = std::thread([this] {
      for (;;) {
        std::function<void()> t;
        {
          std::unique_lock<std::mutex> lk(mu);
          cv.wait(lk, [&] { return stop || has_task; });
          if (stop) return;
          t = std::move(task);
          has_task = false;
        }
        std::exception_ptr e;
        try {
          DeviceGuard g(device);
          t();
        } catch (...) {
          e = std::current_exception();
        }
        std::lock_guard<std::mutex> lk(mu);
        error = e;
        done = true;
        cv.notify_all();
      }
    });
  }
  ~Worker() {
    {
      std::lock_guard<std::mutex> lk(mu);
      stop = true;
    }
    cv.notify_all();
    thread.join();
  }
};

DeviceThreads::DeviceThreads(std::vector<Device> devices) {
  for (const Device& d : devices) workers_.push_back(std::make_unique<Worker>(d));
}

DeviceThreads::~DeviceThreads() = default;

void DeviceThreads::run(const std::vector<std::function<void()>>& tasks) {
  CHORUS_ASSERT(tasks.size() <= workers_.size());
  // Grad mode and autocast are thread-local: each task runs under the
  // caller's, as if the caller had run it (a bf16 step must not silently run
  // its replicas in float32). The guards restore the worker's own state.
  const bool grad = grad_enabled();
  const std::optional<DType> autocast = current_autocast();
  for (size_t i = 0; i < tasks.size(); ++i) {
    Worker& w = *workers_[i];
    std::lock_guard<std::mutex> lk(w.mu);
    w.task = [grad, autocast, t = tasks[i]] {
      const bool prev_grad = grad_enabled();
      set_grad_enabled(grad);
      struct RestoreGrad {
        bool prev;
        ~RestoreGrad() { set_grad_enabled(prev); }
      } restore{prev_grad};
      AutocastGuard cast(autocast);
      t();
    };
    w.has_task = true;
    w.done = false;
    w.error = nullptr;
    w.cv.notify_all();
  }
  std::exception_ptr first;
  Device failed;
  for (size_t i = 0; i < tasks.size(); ++i) {
    Worker& w = *workers_[i];
    std::unique_lock<std::mutex> lk(w.mu);
    w.cv.wait(lk, [&] { return w.done; });
    if (w.error && !first) {
      first = w.error;
      failed = w.device;
    }
  }
  if (!first) return;
  try {
    std::rethrow_exception(first);
  } catch (const Error& e) {
    throw Error("replica on " + failed.str() + " failed: " + e.message());
  } catch (const std::exception& e) {
    throw Error("replica on " + failed.str() + " failed: " + e.what());
  }
}

}  // namespace chorus::parallel
