// Note [NCCL process group]: each collective runs on the group's own
// communication stream. The caller's current stream records an event the
// communication stream waits for (the collective reads what the caller wrote),
// and the communication stream records an event the caller's current stream
// waits for (later work sees the result, and a tensor the caller frees is
// reused only after the collective): ordered by events on the device, never by
// a host wait. A watchdog thread aborts the communicator (ncclCommAbort) when an
// operation has not finished within the timeout (Note [Collective timeouts]); the next call,
// or Work::wait(), then throws the DistError naming the ranks that did not
// arrive.
//
// Note [NCCL in a CUDA graph]: a collective issued while the caller's stream
// is being captured (parallel::GraphedStep, e.g. DDP's bucket all-reduces) is
// recorded into the graph, not run: the communication stream joins the
// capture through the `ready_` event and leaves it again when the caller's
// stream waits for the Work. Such a Work is not given to the watchdog (its
// event means nothing outside the graph). Instead the capture registers, once
// per graph, a check before each replay (a group the watchdog aborted throws
// here, before the graph's collectives run on freed resources) and a watch
// after it: an event on the caller's stream, behind the replay, that the
// watchdog times like any collective, so a rank that dies while the others
// replay is named, not waited for forever.
#include "chorus/core/env_switches.h"
#include "chorus/distributed/nccl_group.h"

#if defined(CHORUS_WITH_CUDA) && defined(CHORUS_WITH_NCCL)

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <string_view>
#include <thread>

#include "chorus/core/error.h"
#include "chorus/core/graph_capture.h"
#include "chorus/cuda/runtime/context.h"
#include "chorus/cuda/runtime/nccl_check.h"
#include "chorus/distributed/collective_watch.h"
#include "chorus/distributed/roll_call.h"
#include "chorus/ops/device_trace.h"

namespace chorus::dist {

namespace {

ncclDataType_t nccl_dtype(DType d) {
  switch (d) {
    case kFloat32: return ncclFloat32;
    case kBFloat16: return ncclBfloat16;
    case kFloat64: return ncclFloat64;
    case kInt64: return ncclInt64;
    default: CHORUS_THROW(ValueError, "nccl: no NCCL type for ", dtype_name(d));
  }
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Avg: return ncclAvg;
    case ReduceOp::Max: return ncclMax;
    case ReduceOp::Min: return ncclMin;
  }
  return ncclSum;
}

class NcclGroup;

class NcclWork final : public Work {
 public:
  NcclWork(NcclGroup* g, const char* op, uint64_t seq, cudaEvent_t done, std::vector<Tensor> keep, bool captured,
           bool watched)
      : g_(g),
        op_(op),
        seq_(seq),
        done_(done),
        started_(std::chrono::steady_clock::now()),
        keep_(std::move(keep)),
        captured_(captured),
        watched_(watched) {}
  ~NcclWork() override;
  bool is_completed() override;
  void wait() override;
  bool finished() { return cudaEventQuery(done_) == cudaSuccess; }
  NcclGroup* g_;
  const char* op_;
  uint64_t seq_;
  cudaEvent_t done_;
  std::chrono::steady_clock::time_point started_;
  std::mutex keep_mu_;
  std::vector<Tensor> keep_;  // the operands, until the caller's stream is ordered after the collective
  const bool captured_;       // issued into a CUDA graph capture (Note [NCCL in a CUDA graph])
  const bool watched_;        // begun in the group's CollectiveWatch (collectives and replays, not send/recv)
};

// Whether work issued to `s` now is recorded into a CUDA graph.
bool is_capturing(cudaStream_t s) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  CHORUS_CUDA_CHECK(cudaStreamIsCapturing(s, &status));
  return status == cudaStreamCaptureStatusActive;
}

class NcclGroup final : public ProcessGroup, public std::enable_shared_from_this<NcclGroup> {
 public:
  NcclGroup(int rank, int size, StorePtr store, ProcessGroupOptions options, int device)
      : ProcessGroup(rank, size, std::move(store), options), device_(device) {
    cuda::CudaDeviceGuard guard(device_);
    ncclUniqueId id;
    const std::string key = "nccl/" + options_.name + "/uid";
    if (rank_ == 0) {
      CHORUS_NCCL_CHECK(ncclGetUniqueId(&id));
      store_->set(key, Bytes(reinterpret_cast<uint8_t*>(&id), reinterpret_cast<uint8_t*>(&id) + sizeof(id)));
    } else {
      Bytes b = store_->get(key);
      CHORUS_CHECK_T(DistError, b.size() == sizeof(id), "nccl: bad unique id in the store");
      std::memcpy(&id, b.data(), sizeof(id));
    }
    // Blocking calls (enqueueing is fast; a non-blocking communicator cost
    // ~90 us per collective in completion polling); ncclCommAbort from the
    // watchdog thread still ends an operation stuck on the device.
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 1;
    ncclResult_t r = ncclCommInitRankConfig(&comm_, size_, id, rank_, &config);
    if (r != ncclSuccess && r != ncclInProgress)
      cuda::throw_nccl_error(r, "ncclCommInitRankConfig", nullptr, "rank " + std::to_string(rank_), __FILE__, __LINE__);
    wait_ready("ncclCommInitRankConfig", options_.timeout);
    // CHORUS_NCCL_STREAM_PRIORITY=high: the communication stream's kernels
    // are scheduled ahead of the compute kernels waiting for SMs (measured in
    // docs/benchmarks.md, session 13).
    const char* prio = chorus::env::get("CHORUS_NCCL_STREAM_PRIORITY");
    if (prio && std::string_view(prio) == "high") {
      int least = 0, greatest = 0;
      CHORUS_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
      CHORUS_CUDA_CHECK(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, greatest));
    } else {
      CHORUS_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    }
    CHORUS_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    // Its kernels on a track of their own in a step trace (Note [Device tracks]).
    ops::name_trace_stream(Device(DeviceType::CUDA, device_), stream_, "nccl stream");
    collectives_ = std::make_unique<CollectiveWatch>(store_, options_.name, "nccl", rank_, size_, options_.timeout);
    collectives_->set_job_ranks(options_.job_ranks);
    watchdog_ = std::thread([this] { watch(); });
  }

  ~NcclGroup() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    if (comm_) {
      if (broken_) {
        (void)ncclCommAbort(comm_);
      } else {
        // Non-blocking: finalize completes asynchronously; destroying before
        // it has crashed the process at exit.
        cuda::CudaDeviceGuard guard(device_);
        ncclResult_t st = ncclCommFinalize(comm_);
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
        while (st == ncclInProgress && std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::microseconds(200));
          if (ncclCommGetAsyncError(comm_, &st) != ncclSuccess) break;
        }
        if (st == ncclSuccess) (void)ncclCommDestroy(comm_);
        else (void)ncclCommAbort(comm_);
      }
    }
  }

  std::string backend() const override { return "nccl"; }
  Device device() const override { return Device(DeviceType::CUDA, device_); }

  WorkPtr all_reduce(const Tensor& t, ReduceOp op) override {
    check_cuda("all_reduce", t);
    return issue("all_reduce", t.nbytes(), {t}, [&](cudaStream_t s) {
      return ncclAllReduce(t.raw_data(), t.raw_data(), t.numel(), nccl_dtype(t.dtype()), nccl_op(op), comm_, s);
    });
  }
  WorkPtr broadcast(const Tensor& t, int root) override {
    check_cuda("broadcast", t);
    CHORUS_CHECK(root >= 0 && root < size_, "broadcast: root ", root, " is not a rank of this group");
    return issue("broadcast", t.nbytes(), {t}, [&](cudaStream_t s) {
      return ncclBroadcast(t.raw_data(), t.raw_data(), t.numel(), nccl_dtype(t.dtype()), root, comm_, s);
    });
  }
  WorkPtr all_gather(const Tensor& in, const Tensor& out) override {
    check_cuda("all_gather", in);
    check_cuda("all_gather", out);
    CHORUS_CHECK(out.dtype() == in.dtype() && out.numel() == in.numel() * size_, "all_gather: out must hold ", size_,
                 " x ", in.numel(), " elements, got ", out.describe());
    return issue("all_gather", out.nbytes(), {in, out}, [&](cudaStream_t s) {
      return ncclAllGather(in.raw_data(), out.raw_data(), in.numel(), nccl_dtype(in.dtype()), comm_, s);
    });
  }
  WorkPtr reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op) override {
    check_cuda("reduce_scatter", in);
    check_cuda("reduce_scatter", out);
    CHORUS_CHECK(out.dtype() == in.dtype() && in.numel() == out.numel() * size_, "reduce_scatter: in must hold ",
                 size_, " x out.numel() elements");
    return issue("reduce_scatter", in.nbytes(), {in, out}, [&](cudaStream_t s) {
      return ncclReduceScatter(in.raw_data(), out.raw_data(), out.numel(), nccl_dtype(in.dtype()), nccl_op(op), comm_,
                               s);
    });
  }
  WorkPtr barrier() override {
    if (!barrier_buf_.defined()) barrier_buf_ = chorus::detail::empty_tensor({1}, kFloat32, Device(DeviceType::CUDA, device_));
    Tensor b = barrier_buf_;
    WorkPtr w = issue("barrier", 0, {b}, [&](cudaStream_t s) {
      return ncclAllReduce(b.raw_data(), b.raw_data(), 1, ncclFloat32, ncclSum, comm_, s);
    });
    // A barrier is a host-side promise: wait for the device here.
    cuda::CudaDeviceGuard guard(device_);
    while (!static_cast<NcclWork*>(w.get())->finished()) {
      check_broken();
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    return w;
  }
  WorkPtr send(const Tensor& t, int dst, int) override {
    check_cuda("send", t);
    check_peer("send", dst, "destination");
    return issue("send", t.nbytes(), {t}, [&](cudaStream_t s) {
      return ncclSend(t.raw_data(), t.numel(), nccl_dtype(t.dtype()), dst, comm_, s);
    });
  }
  WorkPtr recv(const Tensor& t, int src, int) override {
    check_cuda("recv", t);
    check_peer("recv", src, "source");
    return issue("recv", t.nbytes(), {t}, [&](cudaStream_t s) {
      return ncclRecv(t.raw_data(), t.numel(), nccl_dtype(t.dtype()), src, comm_, s);
    });
  }

  // Completion events, reused (creating two per collective cost more than a
  // small all-reduce).
  cudaEvent_t acquire_event() {
    {
      std::lock_guard<std::mutex> lk(events_mu_);
      if (!events_.empty()) {
        cudaEvent_t e = events_.back();
        events_.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    CHORUS_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }
  void release_event(cudaEvent_t e) {
    std::lock_guard<std::mutex> lk(events_mu_);
    events_.push_back(e);
  }

  void check_broken() {
    std::lock_guard<std::mutex> lk(mu_);
    if (broken_) std::rethrow_exception(broken_);
  }

 private:
  void check_cuda(const char* op, const Tensor& t) const {
    check_tensor(op, t);
    CHORUS_CHECK(t.device().is_cuda() && t.device().index == device_, op, ": this NCCL group runs on cuda:", device_,
                 ", got ", t.describe());
  }

  // Polls a non-blocking communicator until its last call has completed
  // (enqueueing a collective takes microseconds: spin, then back off).
  void wait_ready(const char* what, std::chrono::milliseconds timeout) {
    int spins = 0;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      ncclResult_t st = ncclSuccess;
      CHORUS_NCCL_CHECK(ncclCommGetAsyncError(comm_, &st));
      if (st == ncclSuccess) return;
      if (st != ncclInProgress) cuda::throw_nccl_error(st, what, comm_, "", __FILE__, __LINE__);
      if (std::chrono::steady_clock::now() > deadline) {
        (void)ncclCommAbort(comm_);
        comm_ = nullptr;
        std::vector<int> missing = roll_call(*store_, options_.name + "/init", rank_, size_, 0, options_.timeout);
        throw_collective_failure("nccl", what, 0, rank_, missing, "the communicator did not come up", options_.timeout,
                                 job_store(), options_.job_ranks, options_.job_ranks.empty() ? "" : options_.name);
      }
      if (++spins < 100000) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  template <typename Launch>
  WorkPtr issue(const char* op, int64_t bytes, std::vector<Tensor> keep, Launch&& launch) {
    check_broken();
    cuda::CudaDeviceGuard guard(device_);
    cudaStream_t cur = cuda::current_stream(device_);
    const bool captured = is_capturing(cur);
    if (captured) guard_replays(bytes);
    // `ready_` is reused: a wait captures the event's state when enqueued.
    CHORUS_CUDA_CHECK(cudaEventRecord(ready_, cur));
    CHORUS_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0));
    cudaEvent_t done = acquire_event();
    ncclResult_t r;
    {
      // One thread at a time on the communicator: the watchdog polls it too.
      std::lock_guard<std::mutex> comm_lock(comm_mu_);
      r = launch(stream_);
      if (r == ncclInProgress) {
        wait_ready(op, options_.timeout);
        r = ncclSuccess;
      }
    }
    if (r != ncclSuccess) {
      release_event(done);
      report_recent(op, seq_ + 1);
      cuda::throw_nccl_error(r, op, comm_, "", __FILE__, __LINE__);
    }
    CHORUS_CUDA_CHECK(cudaEventRecord(done, stream_));
    // Note [NCCL work ordering]: the caller's stream is not made to wait
    // here: Work::wait() does that. Waiting at issue made every bucket of
    // DDP's backward hold up the rest of the backward until its all-reduce
    // was done -- no overlap at all.
    // Point-to-point operations differ in number between ranks (a middle
    // pipeline stage has twice as many): only collectives are counted, so
    // that a roll call after a failure compares like with like.
    const bool p2p = std::string_view(op) == "send" || std::string_view(op) == "recv";
    const uint64_t seq = p2p ? seq_ : ++seq_;
    // Note [Stuck collectives named early]: collectives, keyed by the
    // sequence number every rank counts alike; a captured one runs only in a
    // replay, which is watched as one (watch_replay).
    const bool watched = !captured && !p2p;
    if (watched) collectives_->begin(op, seq, bytes);
    auto w = std::make_shared<NcclWork>(this, op, seq, done, std::move(keep), captured, watched);
    if (!captured) watch_work(w);
    return w;
  }

  void watch_work(const std::shared_ptr<NcclWork>& w) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      pending_.push_back(w);
    }
    cv_.notify_one();
  }

  // Note [NCCL in a CUDA graph]: once per capture that records a collective
  // of this group; `bytes` (the collective being captured) and those of the
  // capture's later collectives add up to what each replay moves.
  void guard_replays(int64_t bytes) {
    const uint64_t generation = capture_generation();
    if (guarded_generation_.exchange(generation) == generation) {
      if (capture_bytes_) *capture_bytes_ += bytes;
      return;
    }
    capture_bytes_ = std::make_shared<std::atomic<int64_t>>(bytes);
    std::weak_ptr<NcclGroup> weak = weak_from_this();
    before_each_replay([weak] {
      if (auto g = weak.lock()) g->check_broken();
    });
    on_each_replay([weak, moved = capture_bytes_] {
      if (auto g = weak.lock()) g->watch_replay(moved->load());
    });
  }

  // An event behind the replay just issued on the caller's stream, timed by
  // the watchdog as one more collective.
  void watch_replay(int64_t bytes) {
    cuda::CudaDeviceGuard guard(device_);
    cudaEvent_t done = acquire_event();
    CHORUS_CUDA_CHECK(cudaEventRecord(done, cuda::current_stream(device_)));
    const uint64_t seq = ++seq_;
    collectives_->begin("graph replay", seq, bytes);
    watch_work(std::make_shared<NcclWork>(this, "a replayed CUDA graph's collectives", seq, done,
                                          std::vector<Tensor>{}, false, true));
  }

  // The flight recorder (Note [Stuck collectives named early]): this rank's
  // last collectives, once, when the group fails.
  void report_recent(const char* op, uint64_t seq) {
    if (reported_.exchange(true)) return;
    std::fprintf(stderr,
                 "chorus: rank %d: nccl %s #%llu failed; the last collectives of group '%s' (sequence number, op, "
                 "size, time):\n%s",
                 job_rank(rank_), op, static_cast<unsigned long long>(seq), options_.name.c_str(),
                 collectives_->recent().c_str());
    std::fflush(stderr);
    collectives_->end_all();
  }

  // The watchdog: retires finished operations; aborts the communicator when
  // the oldest has run past the timeout.
  void watch() {
    cuda::CudaDeviceGuard guard(device_);
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      // Idle: sleep until work is issued. Work in flight: look again in a
      // millisecond. (Waiting with a "pending is not empty" predicate while
      // work was in flight spun: it held mu_, which every issue() needs, and
      // queried CUDA events back to back, competing with the launching
      // thread for the driver -- the DDP step became bound by the host.)
      if (pending_.empty())
        cv_.wait_for(lk, std::chrono::milliseconds(100), [&] { return stop_ || !pending_.empty(); });
      else
        cv_.wait_for(lk, std::chrono::milliseconds(1), [&] { return stop_; });
      if (stop_) return;
      while (!pending_.empty() && pending_.front()->finished()) {
        if (pending_.front()->watched_) collectives_->end(pending_.front()->seq_);
        pending_.pop_front();
      }
      if (pending_.empty() || broken_) continue;
      std::shared_ptr<NcclWork> oldest = pending_.front();
      ncclResult_t async = ncclSuccess;
      if (std::unique_lock<std::mutex> comm_lock(comm_mu_, std::try_to_lock); comm_lock.owns_lock())
        (void)ncclCommGetAsyncError(comm_, &async);
      const bool late = std::chrono::steady_clock::now() - oldest->started_ > options_.timeout;
      if (!late && (async == ncclSuccess || async == ncclInProgress)) continue;
      lk.unlock();
      report_recent(oldest->op_, oldest->seq_);
      // Roll call first, while the kernels still wait (the other survivors'
      // watchdogs time out at the same moment), and record the failure before
      // the abort: work that then fails on this device reports it (Note
      // [Distributed failure first]).
      std::vector<int> missing = roll_call(*store_, options_.name, rank_, size_, oldest->seq_, options_.timeout,
                                           job_store(), job_rank(rank_));
      std::exception_ptr err;
      try {
        throw_collective_failure("nccl", oldest->op_, oldest->seq_, rank_, missing,
                                 late ? "not finished within the timeout; the communicator was aborted"
                                      : std::string("NCCL reported: ") + ncclGetErrorString(async),
                                 options_.timeout, job_store(), options_.job_ranks,
                                 options_.job_ranks.empty() ? "" : options_.name);
      } catch (const Error& e) {
        err = std::current_exception();
        set_distributed_failure(e.message());  // Note [Distributed failure first]
      }
      // Broken before the abort: ncclCommAbort sets the kernels' abort flag
      // at once (they exit, the streams move on), but then waits until every
      // CUDA graph holding this communicator's collectives is destroyed. The
      // owner of such a graph learns of the failure here (its next replay's
      // check throws), unwinds, destroys the graph, and the abort completes.
      {
        std::lock_guard<std::mutex> relock(mu_);
        broken_ = err;
      }
      ncclComm_t aborting = comm_;
      (void)ncclCommAbort(aborting);
      lk.lock();
      comm_ = nullptr;
      pending_.clear();
    }
  }

  int device_;
  std::mutex comm_mu_;  // NCCL calls on comm_ (issue, watchdog polls); not held while aborting
  cudaEvent_t ready_ = nullptr;
  std::mutex events_mu_;
  std::vector<cudaEvent_t> events_;  // leaked with the group: Works may outlive it briefly
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;  // leaked with the process: tensors may name it
  Tensor barrier_buf_;
  uint64_t seq_ = 0;
  std::atomic<uint64_t> guarded_generation_{0};  // the last capture guard_replays() registered for
  std::shared_ptr<std::atomic<int64_t>> capture_bytes_;  // what the collectives of that capture move
  std::unique_ptr<CollectiveWatch> collectives_;  // Note [Stuck collectives named early]
  std::atomic<bool> reported_{false};             // the flight recorder printed
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<NcclWork>> pending_;
  std::exception_ptr broken_;
  bool stop_ = false;
  std::thread watchdog_;
  friend class NcclWork;
};

// Note [NCCL work ordering]: a collective runs on the group's stream after
// the caller's stream reached the issue; the caller's stream waits for it
// only at wait(), so work issued in between (the rest of a backward) runs
// beside it. The operands stay alive in the Work until then: wait() orders
// the caller's stream after the collective and drops them on the caller's
// thread, so stream-ordered allocation reuses their memory only afterwards.
// A Work never waited for keeps them until the watchdog retires it, i.e.
// until the collective has finished on the device.
NcclWork::~NcclWork() { g_->release_event(done_); }

// A captured collective completes with each replay, which the callers'
// streams are ordered after: outside the capture there is nothing to wait for.
bool NcclWork::is_completed() { return captured_ || finished(); }

void NcclWork::wait() {
  {
    cuda::CudaDeviceGuard guard(g_->device_);
    cudaStream_t cur = cuda::current_stream(g_->device_);
    if (!captured_ || is_capturing(cur)) CHORUS_CUDA_CHECK(cudaStreamWaitEvent(cur, done_, 0));
  }
  std::vector<Tensor> drop;
  {
    std::lock_guard<std::mutex> lk(keep_mu_);
    drop.swap(keep_);
  }
  g_->check_broken();  // the failure, if the watchdog found one
}

}  // namespace

ProcessGroupPtr make_nccl_group(int rank, int size, StorePtr store, ProcessGroupOptions options, int device) {
  return std::make_shared<NcclGroup>(rank, size, std::move(store), options, device);
}

}  // namespace chorus::dist

#endif
