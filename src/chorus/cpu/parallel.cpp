#include "chorus/cpu/parallel.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "chorus/core/env_switches.h"

namespace chorus::cpu {

namespace {

thread_local bool t_in_worker = false;

// A fixed pool; one parallel_for at a time uses it (others run inline), which
// keeps it simple and avoids oversubscription when DataParallel replicas each
// run on their own thread.
class Pool {
 public:
  explicit Pool(int n) {
    for (int i = 0; i < n; ++i) workers_.emplace_back([this] { loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  bool try_run(int64_t n, int64_t chunks, const std::function<void(int64_t, int64_t)>& fn) {
    std::unique_lock<std::mutex> busy(busy_mu_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    {
      std::lock_guard<std::mutex> g(mu_);
      fn_ = &fn;
      n_ = n;
      chunks_ = chunks;
      next_ = 0;
      done_ = 0;
      error_ = nullptr;
      ++generation_;
    }
    cv_.notify_all();
    work();  // the caller takes chunks too
    std::unique_lock<std::mutex> g(mu_);
    done_cv_.wait(g, [&] { return done_ == chunks_; });
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
    return true;
  }

 private:
  void loop() {
    t_in_worker = true;
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> g(mu_);
        cv_.wait(g, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      work();
    }
  }
  void work() {
    for (;;) {
      int64_t c;
      const std::function<void(int64_t, int64_t)>* fn;
      {
        std::lock_guard<std::mutex> g(mu_);
        if (!fn_ || next_ >= chunks_) return;
        c = next_++;
        fn = fn_;
      }
      int64_t b = n_ * c / chunks_, e = n_ * (c + 1) / chunks_;
      try {
        bool prev = t_in_worker;
        t_in_worker = true;
        (*fn)(b, e);
        t_in_worker = prev;
      } catch (...) {
        std::lock_guard<std::mutex> g(mu_);
        if (!error_) error_ = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> g(mu_);
        if (++done_ == chunks_) done_cv_.notify_all();
      }
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mu_, busy_mu_;
  std::condition_variable cv_, done_cv_;
  bool stop_ = false;
  uint64_t generation_ = 0;
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0, chunks_ = 0, next_ = 0, done_ = 0;
  std::exception_ptr error_;
};

Pool& pool() {
  static Pool p(std::max(0, num_threads() - 1));
  return p;
}

}  // namespace

namespace {
std::atomic<int>& thread_count() {
  static std::atomic<int> n([] {
    const char* env = chorus::env::get("CHORUS_NUM_THREADS");
    int v = env ? std::atoi(env) : static_cast<int>(std::thread::hardware_concurrency());
    return std::max(1, v);
  }());
  return n;
}
}  // namespace

int num_threads() { return thread_count().load(std::memory_order_relaxed); }

void set_num_threads(int n) {
  if (n < 1) throw std::invalid_argument("set_num_threads: need at least 1 thread, got " + std::to_string(n));
  thread_count().store(n, std::memory_order_relaxed);
  openblas_set_num_threads(n);
}

bool num_threads_set_by_user() { return chorus::env::get("CHORUS_NUM_THREADS") != nullptr; }

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  int threads = num_threads();
  if (threads == 1 || n < 2 * std::max<int64_t>(grain, 1) || t_in_worker) {
    fn(0, n);
    return;
  }
  int64_t chunks = std::min<int64_t>(threads, n / std::max<int64_t>(grain, 1));
  if (!pool().try_run(n, chunks, fn)) fn(0, n);
}

}  // namespace chorus::cpu
