// CUDA context: error reporting, the per-thread current stream of each device,
// cached device properties and lazily enabled peer access (see context.h).
//
// Streams: see Note [One default stream per device] below. A thread's chosen
// streams (set_current_stream) are per thread; a stream handle must stay valid
// while any allocator block names it, so default streams are never destroyed.
#include "chorus/core/env_switches.h"
#include "chorus/cuda/runtime/context.h"

#include "chorus/core/graph_capture.h"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace chorus::cuda {

void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line) {
  // Clears the runtime's last error so that a non-sticky failure (a bad launch
  // configuration, an invalid argument) does not resurface in the next check.
  (void)cudaGetLastError();
  if (err != cudaErrorStreamCaptureInvalidated)
    note_capture_error(detail::str_cat(cudaGetErrorName(err), " in ", call, " (", file, ":", line, ")"));
  // Note [Distributed failure first] (core/error.h).
  if (std::string dist = distributed_failure(); !dist.empty())
    throw DistError(detail::str_cat(dist, " (then, on this device: ", cudaGetErrorString(err), " in ", call, ")"), file,
                    line);
  throw DeviceError(detail::str_cat("CUDA error: ", cudaGetErrorString(err), " (",
                                    cudaGetErrorName(err), ") in ", call),
                    file, line);
}

namespace {

int visible_device_count() {
  static const int n = [] {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      (void)cudaGetLastError();
      count = 0;
    }
    return count;
  }();
  return n;
}

void check_index(int index) {
  const int n = visible_device_count();
  if (index < 0 || index >= n) {
    CHORUS_THROW(DeviceError, "cuda:", index, " does not exist: this machine has ", n,
                 " CUDA device", n == 1 ? "" : "s");
  }
}

// Streams of exited threads, per device, waiting for a new owner. Leaked on
// purpose: threads may exit during static destruction.
struct StreamFreeList {
  std::mutex mu;
  std::vector<std::vector<cudaStream_t>> per_device;
};
StreamFreeList& stream_free_list() {
  static auto* list = new StreamFreeList;
  return *list;
}

struct ThreadStreams {
  std::vector<cudaStream_t> default_stream;  // created lazily, nullptr until then
  std::vector<cudaStream_t> current;         // nullptr means default_stream
};

// A trivially destructible pointer, so that a late use during thread or process
// exit (a tensor freed by a static destructor) finds it still readable.
thread_local ThreadStreams* t_streams = nullptr;
thread_local bool t_exiting = false;

struct ThreadStreamsReturner {
  ~ThreadStreamsReturner() {
    t_exiting = true;
    if (!t_streams) return;
    StreamFreeList& list = stream_free_list();
    std::lock_guard<std::mutex> g(list.mu);
    if (list.per_device.size() < t_streams->default_stream.size())
      list.per_device.resize(t_streams->default_stream.size());
    for (size_t d = 0; d < t_streams->default_stream.size(); ++d) {
      if (t_streams->default_stream[d]) list.per_device[d].push_back(t_streams->default_stream[d]);
    }
    delete t_streams;
    t_streams = nullptr;
  }
};
thread_local ThreadStreamsReturner t_returner;

ThreadStreams& thread_streams() {
  if (!t_streams) {
    const size_t n = static_cast<size_t>(visible_device_count());
    t_streams = new ThreadStreams{std::vector<cudaStream_t>(n, nullptr),
                                  std::vector<cudaStream_t>(n, nullptr)};
    if (!t_exiting) (void)&t_returner;  // odr-use: registers the destructor
  }
  return *t_streams;
}

// Note [One default stream per device]: every thread that has not chosen a
// stream (StreamGuard / set_current_stream) issues to the device's one
// process-wide non-blocking stream. Work issued by DataParallel's replica
// threads and the backward engine's device threads is then ordered with the
// main thread's work (the optimizer step, the next forward) without events;
// threads that want overlap pick their own streams explicitly.
cudaStream_t default_stream(int index) {
  static std::mutex mu;
  static auto* streams = new std::vector<std::atomic<cudaStream_t>>(static_cast<size_t>(visible_device_count()));
  std::atomic<cudaStream_t>& slot = (*streams)[static_cast<size_t>(index)];
  cudaStream_t s = slot.load(std::memory_order_acquire);
  if (s) return s;
  std::lock_guard<std::mutex> g(mu);
  s = slot.load(std::memory_order_acquire);
  if (s) return s;
  CudaDeviceGuard guard(index);
  CHORUS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  slot.store(s, std::memory_order_release);
  return s;
}

}  // namespace

void set_cuda_device(int index) {
  int cur = -1;
  CHORUS_CUDA_CHECK(cudaGetDevice(&cur));
  if (cur != index) CHORUS_CUDA_CHECK(cudaSetDevice(index));
}

CudaDeviceGuard::CudaDeviceGuard(int index) : prev_(-1) {
  CHORUS_CUDA_CHECK(cudaGetDevice(&prev_));
  if (prev_ != index) CHORUS_CUDA_CHECK(cudaSetDevice(index));
}

CudaDeviceGuard::~CudaDeviceGuard() {
  int cur = -1;
  if (cudaGetDevice(&cur) == cudaSuccess && cur != prev_ && prev_ >= 0) (void)cudaSetDevice(prev_);
}

cudaStream_t current_stream(int index) {
  check_index(index);
  cudaStream_t s = thread_streams().current[static_cast<size_t>(index)];
  return s ? s : default_stream(index);
}

void set_current_stream(int index, cudaStream_t s) {
  check_index(index);
  // nullptr restores the thread's default stream (never the legacy NULL stream).
  thread_streams().current[static_cast<size_t>(index)] = s;
}

bool is_capturing(cudaStream_t s) {
  if (!capture_in_progress()) return false;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(s, &status) != cudaSuccess) (void)cudaGetLastError();
  return status != cudaStreamCaptureStatusNone;
}

bool same_capture(cudaStream_t waiter, cudaStream_t other) {
  if (!capture_in_progress()) return true;
  auto info = [](cudaStream_t s) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    if (cudaStreamGetCaptureInfo(s, &status, &id) != cudaSuccess) {
      (void)cudaGetLastError();
      status = cudaStreamCaptureStatusNone;
    }
    return status == cudaStreamCaptureStatusActive ? id + 1 : 0;  // 0: not captured
  };
  return info(waiter) == info(other);
}

const cudaDeviceProp& device_properties(int index) {
  check_index(index);
  // Read once for every device: kernels ask on every launch (grid sizes), from
  // several threads, so the lookup takes no lock.
  static const std::vector<cudaDeviceProp>* props = [] {
    auto* v = new std::vector<cudaDeviceProp>(static_cast<size_t>(visible_device_count()));
    for (size_t d = 0; d < v->size(); ++d)
      CHORUS_CUDA_CHECK(cudaGetDeviceProperties(&(*v)[d], static_cast<int>(d)));
    return v;
  }();
  return (*props)[static_cast<size_t>(index)];
}

namespace {

struct PeerState {
  std::mutex mu;
  std::map<std::pair<int, int>, bool> enabled;  // pairs tried, and the outcome
  std::map<int, std::vector<cudaMemPool_t>> pools;  // register_device_pool's, by device
  bool allowed = [] {
    const char* e = chorus::env::get("CHORUS_PEER_ACCESS");
    return !(e && std::string(e) == "0");
  }();
};
PeerState& peer_state() {
  static auto* s = new PeerState;  // leaked: used from threads that may outlive statics
  return *s;
}

void set_one_pool_access(cudaMemPool_t pool, int from, bool grant) {
  cudaMemAccessDesc desc{};
  desc.location.type = cudaMemLocationTypeDevice;
  desc.location.id = from;
  desc.flags = grant ? cudaMemAccessFlagsProtReadWrite : cudaMemAccessFlagsProtNone;
  CHORUS_CUDA_CHECK(cudaMemPoolSetAccess(pool, &desc, 1));
}

// Grants (or revokes) `from`'s access to memory of `to`'s stream-ordered
// pools, which cudaDeviceEnablePeerAccess does not cover. Under st.mu.
void set_pool_access(PeerState& st, int from, int to, bool grant) {
  cudaMemPool_t pool;
  CHORUS_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, to));
  set_one_pool_access(pool, from, grant);
  if (auto it = st.pools.find(to); it != st.pools.end())
    for (cudaMemPool_t p : it->second) set_one_pool_access(p, from, grant);
}

}  // namespace

bool peer_access_enabled(int from, int to) {
  if (from == to) return true;
  check_index(from);
  check_index(to);
  PeerState& st = peer_state();
  std::lock_guard<std::mutex> g(st.mu);
  if (!st.allowed) return false;
  auto it = st.enabled.find({from, to});
  if (it != st.enabled.end()) return it->second;

  int can = 0;
  CHORUS_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, from, to));
  bool ok = false;
  if (can) {
    CudaDeviceGuard guard(from);
    cudaError_t err = cudaDeviceEnablePeerAccess(to, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
      err = cudaSuccess;
    }
    if (err == cudaSuccess) {
      set_pool_access(st, from, to, true);
      ok = true;
    } else {
      (void)cudaGetLastError();  // no peer access: copies go through the runtime
    }
  }
  st.enabled[{from, to}] = ok;
  return ok;
}

void register_device_pool(int device, cudaMemPool_t pool) {
  PeerState& st = peer_state();
  std::lock_guard<std::mutex> g(st.mu);
  st.pools[device].push_back(pool);
  for (const auto& [pair, on] : st.enabled)
    if (on && pair.second == device) set_one_pool_access(pool, pair.first, true);
}

void set_peer_access_allowed(bool allowed) {
  PeerState& st = peer_state();
  std::lock_guard<std::mutex> g(st.mu);
  if (st.allowed == allowed) return;
  st.allowed = allowed;
  if (allowed) {
    st.enabled.clear();  // tried again at next use
    return;
  }
  // Work already issued may use the mappings being removed.
  for (int d = 0; d < visible_device_count(); ++d) {
    CudaDeviceGuard guard(d);
    CHORUS_CUDA_CHECK(cudaDeviceSynchronize());
  }
  for (const auto& [pair, on] : st.enabled) {
    if (!on) continue;
    const auto [from, to] = pair;
    set_pool_access(st, from, to, false);
    CudaDeviceGuard guard(from);
    cudaError_t err = cudaDeviceDisablePeerAccess(to);
    if (err == cudaErrorPeerAccessNotEnabled) (void)cudaGetLastError();
    else CHORUS_CUDA_CHECK(err);
  }
  st.enabled.clear();
}

bool peer_access_allowed() {
  PeerState& st = peer_state();
  std::lock_guard<std::mutex> g(st.mu);
  return st.allowed;
}

}  // namespace chorus::cuda
