#include "chorus/core/env_switches.h"
#include "chorus/cuda/runtime/allocator.h"

#include <algorithm>
#include <bit>
#include <cstdio>
#include <cstdlib>

#include "chorus/core/error.h"
#include "chorus/core/persistent_alloc.h"
#include "chorus/core/warn.h"
#include "chorus/cuda/runtime/allocator_errors.h"
#include "chorus/cuda/runtime/context.h"

namespace chorus::cuda {

using detail::is_allocation_failure;
using detail::warn_if_failed;

namespace {

// Note [Allocator front cache].
constexpr size_t kDefaultMaxCachedBlock = size_t{256} << 20;

bool cache_enabled_by_environment() {
  const char* e = chorus::env::get("CHORUS_CUDA_CACHE");
  return !(e && std::string(e) == "0");
}

bool persistent_pool_by_environment() {
  const char* e = chorus::env::get("CHORUS_CUDA_PERSISTENT_POOL");
  return !(e && std::string(e) == "0");
}

}  // namespace

std::string format_bytes(double bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 6) {
    bytes /= 1024.0;
    ++u;
  }
  char buf[32];
  if (u == 0) std::snprintf(buf, sizeof buf, "%.0f B", bytes);
  else std::snprintf(buf, sizeof buf, "%.2f %s", bytes, kUnits[u]);
  return buf;
}

// ---- EventPool ----------------------------------------------------------------

EventPool::EventPool(int device_count) {
  for (int d = 0; d < device_count; ++d) devices_.push_back(std::make_unique<PerDevice>());
}

EventPool::~EventPool() {
  for (auto& pd : devices_)
    for (cudaEvent_t e : pd->free) warn_if_failed(cudaEventDestroy(e), "cudaEventDestroy");
}

cudaEvent_t EventPool::acquire(int device) {
  PerDevice& pd = *devices_.at(static_cast<size_t>(device));
  {
    std::lock_guard<std::mutex> g(pd.mu);
    if (!pd.free.empty()) {
      cudaEvent_t e = pd.free.back();
      pd.free.pop_back();
      return e;
    }
  }
  CudaDeviceGuard guard(device);
  cudaEvent_t e;
  CHORUS_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

void EventPool::release(int device, cudaEvent_t e) noexcept {
  PerDevice& pd = *devices_[static_cast<size_t>(device)];
  std::lock_guard<std::mutex> g(pd.mu);
  pd.free.push_back(e);
}

// ---- CudaAllocator --------------------------------------------------------------

CudaAllocator::CudaAllocator(int device_count, EventPool* events)
    : events_(events),
      cache_enabled_(cache_enabled_by_environment()),
      persistent_enabled_(persistent_pool_by_environment()),
      max_cached_block_(kDefaultMaxCachedBlock),
      max_cached_total_(0) {
  for (int d = 0; d < device_count; ++d) devices_.push_back(std::make_unique<DeviceState>());
}

size_t CudaAllocator::size_class(size_t n) {
  // Note [Allocator front cache]: 512 B steps up to 4 KiB, then 8 classes per
  // power of two, in steps of at most 2 MiB.
  constexpr size_t kSmallStep = 512, kSmallMax = 4096, kMaxStep = size_t{2} << 20;
  if (n <= kSmallMax) return (std::max<size_t>(n, 1) + kSmallStep - 1) / kSmallStep * kSmallStep;
  const size_t step = std::min(std::bit_floor(n) / 8, kMaxStep);
  return (n + step - 1) / step * step;
}

void CudaAllocator::set_cache_limits(size_t max_block, size_t max_total) {
  max_cached_block_.store(max_block, std::memory_order_relaxed);
  max_cached_total_.store(max_total, std::memory_order_relaxed);
}

void CudaAllocator::set_cache_enabled(bool enabled) {
  cache_enabled_.store(enabled, std::memory_order_relaxed);
  if (!enabled)
    for (size_t d = 0; d < devices_.size(); ++d) release_cached(static_cast<int>(d));
}

CudaAllocator::DeviceState& CudaAllocator::state(int device) const {
  if (device < 0 || static_cast<size_t>(device) >= devices_.size()) {
    CHORUS_THROW(DeviceError, "cuda:", device, " does not exist: this machine has ",
                 devices_.size(), " CUDA devices");
  }
  return *devices_[static_cast<size_t>(device)];
}

cudaMemPool_t CudaAllocator::pool(int device, DeviceState& st) {
  std::lock_guard<std::mutex> g(st.mu);
  if (!st.pool) {
    cudaMemPool_t p;
    CHORUS_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&p, device));
    // Keep freed memory in the pool instead of returning it to the driver at
    // every synchronisation: this is what makes the pool a cache.
    uint64_t threshold = UINT64_MAX;
    CHORUS_CUDA_CHECK(cudaMemPoolSetAttribute(p, cudaMemPoolAttrReleaseThreshold, &threshold));
    st.default_cap = device_properties(device).totalGlobalMem / 8;
    st.pool = p;
  }
  return st.pool;
}

void CudaAllocator::throw_oom(size_t nbytes, int device, const DeviceState& st) const {
  size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) != cudaSuccess) (void)cudaGetLastError();
  size_t in_use;
  {
    std::lock_guard<std::mutex> g(st.mu);
    in_use = st.in_use;
  }
  CHORUS_THROW(OutOfMemoryError, "out of memory on cuda:", device, ": tried to allocate ",
               format_bytes(static_cast<double>(nbytes)), "; ",
               format_bytes(static_cast<double>(in_use)), " in use by Chorus, ",
               format_bytes(static_cast<double>(free)), " free of ",
               format_bytes(static_cast<double>(total)),
               " (free fewer tensors, or use a smaller batch)");
}

CudaAllocator::CachedBlock CudaAllocator::take_cached_locked(DeviceState& st, cudaStream_t stream,
                                                             size_t cls) {
  for (StreamCache& sc : st.caches) {
    if (sc.stream != stream) continue;
    auto it = sc.by_class.find(cls);
    if (it == sc.by_class.end() || it->second.empty()) return {};
    CachedBlock node = std::move(it->second.back());
    it->second.pop_back();
    st.cached -= cls;
    return node;
  }
  return {};
}

bool CudaAllocator::cache_locked(DeviceState& st, cudaStream_t stream, CachedBlock& node) {
  const size_t cls = node.mapped().capacity;
  if (cls == 0 || !cache_enabled() || cls > max_cached_block_.load(std::memory_order_relaxed))
    return false;
  const size_t limit = max_cached_total_.load(std::memory_order_relaxed);
  if (st.cached + cls > (limit ? limit : st.default_cap)) return false;
  StreamCache* sc = nullptr;
  for (StreamCache& c : st.caches)
    if (c.stream == stream) sc = &c;
  if (!sc) {
    st.caches.push_back(StreamCache{stream, {}});
    sc = &st.caches.back();
  }
  Block& b = node.mapped();
  b.uses.clear();  // their waits are enqueued on `stream`
  b.home = stream;
  sc->by_class[cls].push_back(std::move(node));
  st.cached += cls;
  return true;
}

std::vector<std::pair<cudaStream_t, CudaAllocator::CachedBlock>> CudaAllocator::drain_locked(
    DeviceState& st, cudaStream_t only) {
  std::vector<std::pair<cudaStream_t, CachedBlock>> out;
  for (StreamCache& sc : st.caches) {
    if (only && sc.stream != only) continue;
    for (auto& [cls, nodes] : sc.by_class) {
      for (CachedBlock& node : nodes) {
        st.cached -= cls;
        out.emplace_back(sc.stream, std::move(node));
      }
    }
    sc.by_class.clear();
  }
  std::erase_if(st.caches, [&](const StreamCache& sc) { return !only || sc.stream == only; });
  return out;
}

void CudaAllocator::free_to_pool(int device,
                                 const std::vector<std::pair<cudaStream_t, CachedBlock>>& blocks) noexcept {
  if (blocks.empty()) return;
  try {
    CudaDeviceGuard guard(device);
    for (const auto& [stream, node] : blocks)
      warn_if_failed(cudaFreeAsync(reinterpret_cast<void*>(node.key()), stream), "cudaFreeAsync");
  } catch (const std::exception& e) {
    warnf("freeing cached CUDA memory failed: ", e.what());
  }
}

void CudaAllocator::release_cached(int device) {
  DeviceState& st = state(device);
  std::vector<std::pair<cudaStream_t, CachedBlock>> blocks;
  {
    std::lock_guard<std::mutex> g(st.mu);
    blocks = drain_locked(st, nullptr);
  }
  free_to_pool(device, blocks);
}

void* CudaAllocator::allocate(size_t nbytes, int device) {
  DeviceState& st = state(device);
  if (nbytes == 0) return nullptr;
  cudaStream_t stream = current_stream(device);
  if (st.capture_active.load(std::memory_order_acquire)) {
    if (void* p = allocate_captured(st, nbytes, device, stream)) return p;
  } else if (is_capturing(stream)) {
    // Joined through an event from a capture begun on another device.
    CHORUS_THROW(CaptureError, "a captured step allocated memory on cuda:", device,
                 ", which is not the device it is captured on (a graph holds the work of one device)");
  }
  if (persistent_enabled_ && PersistentAllocations::active()) return allocate_persistent(st, nbytes, device, stream);
  // Note [Allocator front cache]: a hit takes no CUDA call (not even a device
  // switch).
  bool cacheable = cache_enabled() && nbytes <= max_cached_block_.load(std::memory_order_relaxed);
  size_t cls = cacheable ? size_class(nbytes) : nbytes;
  if (cls < nbytes) {  // rounding overflowed: an absurd request, which will fail
    cacheable = false;
    cls = nbytes;
  }
  if (cacheable) {
    std::lock_guard<std::mutex> g(st.mu);
    CachedBlock node = take_cached_locked(st, stream, cls);
    if (!node.empty()) {
      void* ptr = reinterpret_cast<void*>(node.key());
      Block& b = node.mapped();
      b.size = nbytes;
      b.capacity = cls;
      b.home = stream;
      b.uses.clear();
      st.blocks.insert(std::move(node));
      st.in_use += nbytes;
      if (st.in_use > st.peak) st.peak = st.in_use;
      return ptr;
    }
  }

  CudaDeviceGuard guard(device);
  (void)pool(device, st);  // configured before the first allocation
  void* ptr = nullptr;
  cudaError_t err = cudaMallocAsync(&ptr, cls, stream);
  if (is_allocation_failure(err)) {
    // The cache and the pool may hold memory freed on other streams that is
    // not yet reusable from this one: give the cache back, wait for
    // everything, trim the pool, try once more.
    (void)cudaGetLastError();
    free_everything_unused(device, st);
    err = cudaMallocAsync(&ptr, cls, stream);
  }
  if (is_allocation_failure(err)) {
    (void)cudaGetLastError();
    throw_oom(nbytes, device, st);
  }
  CHORUS_CUDA_CHECK(err);

  std::lock_guard<std::mutex> g(st.mu);
  st.blocks[reinterpret_cast<uintptr_t>(ptr)] = Block{nbytes, cacheable ? cls : 0, stream, {}};
  st.in_use += nbytes;
  if (st.in_use > st.peak) st.peak = st.in_use;
  return ptr;
}

void CudaAllocator::deallocate(void* ptr, int device) noexcept {
  if (!ptr) return;
  try {
    DeviceState& st = state(device);
    cudaStream_t stream = current_stream(device);
    CachedBlock node;
    bool tried = false;  // the caps already refused it
    GraphPool* retain = nullptr;
    {
      std::lock_guard<std::mutex> g(st.mu);
      auto it = st.blocks.find(reinterpret_cast<uintptr_t>(ptr));
      if (it == st.blocks.end()) {
        warnf("freeing ", ptr, " on cuda:", device, ", which Chorus did not allocate");
        return;
      }
      node = st.blocks.extract(it);
      st.in_use -= node.mapped().size;
      // Note [Graph pools]: a pool block goes back to its pool; a block from
      // outside freed by a captured stream is kept for the graph.
      if (!node.mapped().pool && st.capture_active.load(std::memory_order_acquire) && st.capturing) {
        cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
        if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) (void)cudaGetLastError();
        if (status == cudaStreamCaptureStatusActive) retain = st.capturing;
      }
      // Used on `stream` only: nothing to wait for, no CUDA call.
      const Block& b = node.mapped();
      if (b.home == stream && b.uses.empty() && !b.pool && !retain) {
        if (cache_locked(st, stream, node)) return;
        tried = true;
      }
    }
    Block& block = node.mapped();
    if (retain) {
      // Kept until the graph's pool is freed (cudaFree waits for the device):
      // no wait to enqueue, and a captured stream may not wait on eager work.
      std::lock_guard<std::mutex> g(st.mu);
      for (Use& u : block.uses)
        if (u.event) events_->release(u.device, u.event);
      retain->retained.push_back(ptr);
      retain->retained_bytes += block.size;
      st.in_use += block.size;  // reserved for the graph until its pool goes
      retain->held += block.size;
      return;
    }
    if ((block.home && block.home != stream) || !block.uses.empty()) {
      CudaDeviceGuard guard(device);
      // Makes `stream` wait for the work enqueued so far on `other` (of device
      // `dev`), through an event recorded now: the allocation may have been
      // used on `other` after record_use() named it (Note [Freeing across
      // streams]).
      auto wait_for = [&](int dev, cudaStream_t other) {
        cudaEvent_t e = events_->acquire(dev);
        cudaError_t err;
        {
          CudaDeviceGuard g(dev);  // the event and the stream live on `dev`
          err = cudaEventRecord(e, other);
        }
        warn_if_failed(err, "cudaEventRecord (free)");
        if (err == cudaSuccess)
          warn_if_failed(cudaStreamWaitEvent(stream, e, 0), "cudaStreamWaitEvent (free)");
        events_->release(dev, e);  // the wait is enqueued; the event may be reused
      };
      if (block.home && block.home != stream) wait_for(device, block.home);
      for (Use& u : block.uses) {
        if (u.event) {  // the stream was destroyed; the event marks its last work
          warn_if_failed(cudaStreamWaitEvent(stream, u.event, 0), "cudaStreamWaitEvent (free)");
          events_->release(u.device, u.event);
          u.event = nullptr;
        } else if (u.stream && u.stream != stream) {
          wait_for(u.device, u.stream);
        }
      }
      block.uses.clear();
    }
    // Every earlier use is now ordered before this point of `stream`.
    if (GraphPool* gp = node.mapped().pool) {
      std::vector<void*> dead;
      {
        std::lock_guard<std::mutex> g(st.mu);
        const size_t carved = node.mapped().capacity;
        gp->arena(carved).give(node.key(), carved, stream);  // first: it checks the block
        // Still reserved for the graph: counted in use until the pool goes.
        st.in_use += carved;
        gp->held += carved;
        gp->live_bytes -= node.mapped().size;
        --gp->live;
        dead = take_if_dead_locked(st, gp);
      }
      free_pool_memory(device, dead);
      return;
    }
    if (!tried) {
      std::lock_guard<std::mutex> g(st.mu);
      if (cache_locked(st, stream, node)) return;
    }
    CudaDeviceGuard guard(device);
    warn_if_failed(cudaFreeAsync(ptr, stream), "cudaFreeAsync");
  } catch (const std::exception& e) {
    warnf("freeing CUDA memory failed: ", e.what());
  }
}

void CudaAllocator::record_use(const void* ptr, int owner, int user, cudaStream_t stream) {
  DeviceState& st = state(owner);
  std::lock_guard<std::mutex> g(st.mu);
  const auto addr = reinterpret_cast<uintptr_t>(ptr);
  auto it = st.blocks.upper_bound(addr);
  if (it == st.blocks.begin()) return;
  --it;
  if (addr >= it->first + it->second.size) return;  // not ours
  Block& block = it->second;
  if (user == owner && stream == block.home) return;  // ordered by the home-stream wait
  for (const Use& u : block.uses)
    if (u.device == user && u.stream == stream) return;  // already remembered
  // Only the stream is remembered: the event is recorded when the block is
  // freed, so that it also covers work enqueued after this call.
  block.uses.push_back(Use{user, stream, nullptr});
}

void CudaAllocator::stream_destroyed(int device, cudaStream_t stream) {
  // The blocks cached on `stream` go back to the pool on it, while it exists.
  {
    DeviceState& st = state(device);
    std::vector<std::pair<cudaStream_t, CachedBlock>> cached;
    {
      std::lock_guard<std::mutex> g(st.mu);
      cached = drain_locked(st, stream);
    }
    free_to_pool(device, cached);
  }
  CudaDeviceGuard guard(device);
  // An event recorded on `stream` now marks its last work for every block that
  // names it. Each conversion is done whole (event acquired and recorded before
  // the block forgets the stream), so that a failure leaves no use unordered.
  auto last_work = [&]() {
    cudaEvent_t e = events_->acquire(device);
    cudaError_t err = cudaEventRecord(e, stream);
    if (err != cudaSuccess) {
      events_->release(device, e);
      CHORUS_CUDA_CHECK(err);
    }
    return e;
  };
  for (size_t d = 0; d < devices_.size(); ++d) {
    DeviceState& st = *devices_[d];
    std::lock_guard<std::mutex> g(st.mu);
    for (auto& [addr, block] : st.blocks) {
      for (Use& u : block.uses) {
        if (u.device == device && u.stream == stream) {
          u.event = last_work();
          u.stream = nullptr;
        }
      }
      if (static_cast<int>(d) == device && block.home == stream) {
        cudaEvent_t e = last_work();
        block.uses.push_back(Use{device, nullptr, e});
        block.home = nullptr;
      }
    }
  }
}

AllocatorMemory CudaAllocator::memory(int device) const {
  const DeviceState& st = state(device);
  AllocatorMemory m;
  {
    std::lock_guard<std::mutex> g(st.mu);
    m.in_use = st.in_use;
    m.cached = st.cached;
    for (const auto& gp : st.graph_pools) {
      m.graph_raw += gp->raw_bytes;
      m.graph_retained += gp->retained_bytes;
      m.graph_counted += gp->live_bytes + gp->held;
    }
  }
  cudaMemPool_t pools[2] = {nullptr, nullptr};
  if (cudaDeviceGetDefaultMemPool(&pools[0], device) != cudaSuccess) (void)cudaGetLastError();
  {
    std::lock_guard<std::mutex> g(st.mu);
    pools[1] = st.persistent;  // Note [Persistent allocations]
  }
  for (cudaMemPool_t p : pools) {
    uint64_t reserved = 0, used = 0;
    if (!p) continue;
    if (cudaMemPoolGetAttribute(p, cudaMemPoolAttrReservedMemCurrent, &reserved) == cudaSuccess &&
        cudaMemPoolGetAttribute(p, cudaMemPoolAttrUsedMemCurrent, &used) == cudaSuccess) {
      m.pool_reserved += static_cast<size_t>(reserved);
      m.pool_used += static_cast<size_t>(used);
    } else {
      (void)cudaGetLastError();
    }
  }
  return m;
}

size_t CudaAllocator::bytes_in_use(int device) const {
  const DeviceState& st = state(device);
  std::lock_guard<std::mutex> g(st.mu);
  return st.in_use;
}

size_t CudaAllocator::peak_bytes(int device) const {
  const DeviceState& st = state(device);
  std::lock_guard<std::mutex> g(st.mu);
  return st.peak;
}

void CudaAllocator::reset_peak_bytes(int device) {
  DeviceState& st = state(device);
  std::lock_guard<std::mutex> g(st.mu);
  st.peak = st.in_use;
}

size_t CudaAllocator::cached_bytes(int device) const {
  const DeviceState& st = state(device);
  std::lock_guard<std::mutex> g(st.mu);
  return st.cached;
}

}  // namespace chorus::cuda
