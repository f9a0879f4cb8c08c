// The CUDA allocator's two pools besides the stream-ordered default one:
// a CUDA graph's private pool (Note [Graph pools] in allocator.h) and the
// pool of what a run keeps for good (Note [Persistent allocations] in
// core/persistent_alloc.h). The front cache and the common paths are in
// allocator.cpp.
#include "chorus/cuda/runtime/allocator.h"

#include <cstdint>

#include "chorus/core/error.h"
#include "chorus/cuda/runtime/allocator_errors.h"
#include "chorus/cuda/runtime/context.h"

namespace chorus::cuda {

using detail::is_allocation_failure;
using detail::warn_if_failed;

namespace {

// The persistent pool's and the graph pools' blocks: whole 512-byte units.
size_t rounded_to_512(size_t n) { return (n + 511) / 512 * 512; }

}  // namespace

// ---- Note [Persistent allocations] ---------------------------------------------

cudaMemPool_t CudaAllocator::persistent_pool(int device, DeviceState& st) {
  cudaMemPool_t made = nullptr;
  {
    std::lock_guard<std::mutex> g(st.mu);
    if (st.persistent) return st.persistent;
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    CHORUS_CUDA_CHECK(cudaMemPoolCreate(&made, &props));
    uint64_t threshold = UINT64_MAX;  // kept for the process, as the default pool
    CHORUS_CUDA_CHECK(cudaMemPoolSetAttribute(made, cudaMemPoolAttrReleaseThreshold, &threshold));
    st.persistent = made;
  }
  // Peers reach it as they reach the default pool (a kernel or a copy on
  // another GPU reading a kept weight copy).
  register_device_pool(device, made);
  return made;
}

void CudaAllocator::free_everything_unused(int device, DeviceState& st) {
  // The cache and the pools may hold memory freed on other streams that is
  // not yet reusable from this one: give the cache back, wait for
  // everything, trim the pools.
  release_cached(device);
  CudaDeviceGuard guard(device);
  CHORUS_CUDA_CHECK(cudaDeviceSynchronize());
  CHORUS_CUDA_CHECK(cudaMemPoolTrimTo(pool(device, st), 0));
  cudaMemPool_t persistent;
  {
    std::lock_guard<std::mutex> g(st.mu);
    persistent = st.persistent;
  }
  if (persistent) CHORUS_CUDA_CHECK(cudaMemPoolTrimTo(persistent, 0));
}

void* CudaAllocator::allocate_persistent(DeviceState& st, size_t nbytes, int device, cudaStream_t stream) {
  const size_t n = rounded_to_512(nbytes);
  if (n < nbytes) throw_oom(nbytes, device, st);  // rounding overflowed: an absurd request
  CudaDeviceGuard guard(device);
  (void)pool(device, st);  // the default pool's settings and the cache's cap
  cudaMemPool_t p = persistent_pool(device, st);
  void* ptr = nullptr;
  cudaError_t err = cudaMallocFromPoolAsync(&ptr, n, p, stream);
  if (is_allocation_failure(err)) {
    (void)cudaGetLastError();
    free_everything_unused(device, st);
    err = cudaMallocFromPoolAsync(&ptr, n, p, stream);
  }
  if (is_allocation_failure(err)) {
    (void)cudaGetLastError();
    throw_oom(nbytes, device, st);
  }
  CHORUS_CUDA_CHECK(err);
  std::lock_guard<std::mutex> g(st.mu);
  // Capacity 0: never cached; its free goes back to the pool it came from.
  st.blocks[reinterpret_cast<uintptr_t>(ptr)] = Block{nbytes, 0, stream, {}};
  st.in_use += nbytes;
  if (st.in_use > st.peak) st.peak = st.in_use;
  return ptr;
}

// ---- Note [Graph pools] ------------------------------------------------------

namespace {

// Note [Graph pools]: the segment made for a request carved as `carved`
// bytes when no free range of its stream fits.
size_t segment_size(size_t carved) {
  constexpr size_t kMiB = size_t{1} << 20;
  if (carved <= CudaAllocator::GraphPool::kSmallRequest) return 2 * kMiB;
  if (carved < 10 * kMiB) return 20 * kMiB;
  return (carved + 2 * kMiB - 1) / (2 * kMiB) * (2 * kMiB);
}

}  // namespace

void* CudaAllocator::carve_locked(DeviceState& st, GraphPool* gp, size_t nbytes, size_t carved,
                                  cudaStream_t stream) {
  std::optional<chorus::detail::RangeArena::Taken> t = gp->arena(carved).take(carved, stream);
  if (!t) return nullptr;
  gp->held -= t->size;  // was counted in use while free
  st.in_use -= t->size;
  st.blocks[t->addr] = Block{nbytes, t->size, stream, {}, gp};
  ++gp->live;
  gp->live_bytes += nbytes;
  st.in_use += nbytes;
  if (st.in_use > st.peak) st.peak = st.in_use;
  return reinterpret_cast<void*>(t->addr);
}

void* CudaAllocator::allocate_captured(DeviceState& st, size_t nbytes, int device, cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) (void)cudaGetLastError();
  if (status != cudaStreamCaptureStatusActive) return nullptr;
  const size_t carved = rounded_to_512(nbytes);
  // Rounding would overflow: an absurd request.
  if (carved < nbytes || carved > SIZE_MAX - (size_t{2} << 20)) throw_oom(nbytes, device, st);
  GraphPool* gp = nullptr;
  {
    std::lock_guard<std::mutex> g(st.mu);
    gp = st.capturing;
    if (!gp) return nullptr;
    if (void* p = carve_locked(st, gp, nbytes, carved, stream)) return p;
  }
  CudaDeviceGuard guard(device);
  const size_t seg = segment_size(carved);
  void* ptr = nullptr;
  // cudaMalloc is not captured; Relaxed lets this thread call it whatever
  // mode the capture was begun in (as PyTorch's allocator does).
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  CHORUS_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
  cudaError_t err = cudaMalloc(&ptr, seg);
  (void)cudaThreadExchangeStreamCaptureMode(&mode);
  if (is_allocation_failure(err)) {
    (void)cudaGetLastError();
    throw_oom(nbytes, device, st);
  }
  CHORUS_CUDA_CHECK(err);
  std::unique_lock<std::mutex> g(st.mu);
  if (st.capturing != gp) {  // the capture ended (or another began) meanwhile
    g.unlock();
    warn_if_failed(cudaFree(ptr), "cudaFree (graph segment)");
    CHORUS_THROW(CaptureError, "cuda:", device, ": the graph capture ended while it allocated");
  }
  gp->raw.push_back(ptr);
  gp->raw_bytes += seg;
  gp->held += seg;  // free until carved
  st.in_use += seg;
  gp->arena(carved).add_segment(reinterpret_cast<uintptr_t>(ptr), seg, stream);
  void* p = carve_locked(st, gp, nbytes, carved, stream);
  CHORUS_CHECK(p, "cuda:", device, ": a new graph segment could not hold its request");
  return p;
}

CudaAllocator::GraphPool* CudaAllocator::begin_capture(int device) {
  DeviceState& st = state(device);
  // The front cache and the stream-ordered pool keep memory of the eager
  // steps that the graph's pool (plain cudaMalloc) could not otherwise use.
  free_everything_unused(device, st);  // the cache, both pools trimmed
  std::lock_guard<std::mutex> g(st.mu);
  CHORUS_CHECK(!st.capturing, "cuda:", device, ": a graph capture is already in progress");
  auto gp = std::make_unique<GraphPool>();
  gp->device = device;
  st.capturing = gp.get();
  st.graph_pools.push_back(std::move(gp));
  st.capture_active.store(true, std::memory_order_release);
  return st.capturing;
}

void CudaAllocator::end_capture(int device) noexcept {
  DeviceState& st = *devices_[static_cast<size_t>(device)];
  std::lock_guard<std::mutex> g(st.mu);
  st.capturing = nullptr;
  st.capture_active.store(false, std::memory_order_release);
}

std::vector<void*> CudaAllocator::take_if_dead_locked(DeviceState& st, GraphPool* gp) {
  if (!gp->released || gp->live != 0 || st.capturing == gp) return {};
  std::vector<void*> ptrs = std::move(gp->raw);
  ptrs.insert(ptrs.end(), gp->retained.begin(), gp->retained.end());
  st.in_use -= gp->held;
  std::erase_if(st.graph_pools, [&](const std::unique_ptr<GraphPool>& p) { return p.get() == gp; });
  return ptrs;
}

void CudaAllocator::free_pool_memory(int device, const std::vector<void*>& ptrs) noexcept {
  if (ptrs.empty()) return;
  try {
    CudaDeviceGuard guard(device);
    // cudaFree waits for the device, so no replay can still be using them
    // (it also frees the retained blocks, which came from cudaMallocAsync).
    for (void* p : ptrs) warn_if_failed(cudaFree(p), "cudaFree (graph pool)");
  } catch (const std::exception& e) {
    warnf("freeing a CUDA graph's memory failed: ", e.what());
  }
}

void CudaAllocator::release_pool(GraphPool* gp) noexcept {
  if (!gp) return;
  DeviceState& st = *devices_[static_cast<size_t>(gp->device)];
  const int device = gp->device;
  std::vector<void*> dead;
  {
    std::lock_guard<std::mutex> g(st.mu);
    gp->released = true;
    dead = take_if_dead_locked(st, gp);
  }
  free_pool_memory(device, dead);
}

size_t CudaAllocator::graph_pool_bytes(int device) const {
  const DeviceState& st = state(device);
  std::lock_guard<std::mutex> g(st.mu);
  size_t total = 0;
  for (const auto& gp : st.graph_pools) total += gp->raw_bytes + gp->retained_bytes;
  return total;
}

}  // namespace chorus::cuda
