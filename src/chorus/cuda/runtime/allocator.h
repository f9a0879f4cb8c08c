// CUDA device memory: CUDA's stream-ordered pools (cudaMallocAsync/cudaFreeAsync)
// with the bookkeeping Chorus needs on top: bytes in use and peak per device,
// and the streams that read a block besides the one it was allocated on.
//
// Note [Freeing across streams]: a block is allocated on the current stream of
// the allocating thread (its "home" stream) and freed on the current stream of
// the freeing thread. Before cudaFreeAsync, the freeing stream waits (through
// events, never on the host) for
//   - the home stream, when it differs from the freeing stream, and
//   - every stream named by record_use(),
// so the pool never hands the memory out again while any of them may still
// touch it.
//
// record_use() only remembers the stream; the events are recorded at free
// time, on each remembered stream (as PyTorch's recordStream does). An event
// recorded inside record_use() would mark only the work enqueued before the
// call, yet callers may name the stream before enqueuing the read (record_use,
// then launch) as well as after (launch, then record_use, as the copies do):
// recording at free time covers both, and everything else enqueued on that
// stream until the free. Destroying a stream records an event on it for each
// block that names it (its last work), so freeing later needs no stream that
// no longer exists.
//
// Note [Allocator front cache]: cudaMallocAsync/cudaFreeAsync cost a few
// microseconds of host time each, and a training step makes hundreds of
// allocations, issued from the host threads that also launch the kernels (one
// per GPU under DataParallel). So a block freed on stream S is kept, after the
// waits above are enqueued on S, in S's free list instead of going back to the
// pool; an allocation on S of the same size class takes it back with no CUDA
// call. Stream order makes this as safe as the pool's own reuse: everything
// that touched the block is ordered before the free point on S, and the new
// owner's work on S comes after it. A block cached on S is never handed to
// another stream; it goes back to the pool (cudaFreeAsync on S) only when
//   - an allocation fails: every cached block of the device is freed, then the
//     device synchronised and the pool trimmed before the one retry;
//   - S is destroyed (stream_destroyed);
//   - release_cached() is called (DeviceBackend::empty_cache).
// Size classes: a request of n bytes is served by a block of size_class(n)
// bytes: multiples of 512 B up to 4 KiB, then 8 classes per power of two
// (steps of 1/8 of the power of two below n, at most 2 MiB), so the slack is
// at most 12.5% of the request and at most 2 MiB. A repeated training step
// asks for the same sizes each time, so after the first step nearly every
// allocation is a hit.
// Caps: blocks above max_cached_block (256 MiB by default) are allocated with
// their exact size and always freed to the pool: they are rare, the work on
// them dwarfs two API calls, and a large block stranded in one stream's cache
// is the costliest kind of fragmentation. The cached bytes of a device are
// capped (by default 1/8 of its memory): past that, frees go to the pool. The
// cache holds memory the pool would otherwise reuse for other sizes and
// streams, so the cap bounds how much the pool may grow beyond what the
// tensors need; an allocation never fails because of it (the cache is
// released before giving up). CHORUS_CUDA_CACHE=0 in the environment turns
// the cache off (every allocation and free calls CUDA), for comparisons.
// Accounting: bytes_in_use() counts the bytes requested by live blocks (not
// their size class, not cached blocks) and the blocks graphs hold
// (Note [Graph pools]); cached_bytes() the size-class bytes of
// the cached blocks.
// Note [Graph pools]: while a CUDA graph is captured on a device
// (begin_capture .. end_capture), allocations made on a stream that is being
// captured come from a pool private to that graph: segments taken with plain
// cudaMalloc (cudaMallocAsync inside a capture would become graph memory
// nodes, which the graph frees itself and re-allocates at every launch),
// carved best fit and merged again when freed (core/range_arena.h), reused
// within the capture only by the stream that freed them (Note [Free ranges by
// stream]). Requests of up to 1 MiB share 2 MiB segments; larger ones take
// 20 MiB segments below 10 MiB, else their size rounded up to 2 MiB (the
// split PyTorch's caching allocator makes, which keeps small temporaries from
// cutting up the large blocks). Exact size classes, the front cache's rule,
// are not enough here: the backward's gradients could not use the forward's
// freed activations, and gpt2-xl's graph pool grew 5.75 GiB past the eager
// step's peak. The graph bakes the addresses in, so a block never serves an
// allocation outside the capture: a pool block freed later (a gradient, an
// output) goes back to its pool, and the pool's memory is returned only when
// the graph is released and its last block freed. A block from outside the
// pool that a captured stream frees (the graph may still read it at replay)
// is retained by the pool the same way instead of going back to the cache.
// Threads: one mutex per device guards its live blocks and its cache
// (allocate and deallocate call CUDA outside it). Several threads may allocate
// and free on one device (and on one stream: DataParallel's replica threads
// and the backward engine share the device's default stream).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "chorus/core/range_arena.h"

namespace chorus::cuda {

// Reusable events (cudaEventDisableTiming) per device: creating one is a driver
// call, and an event may be re-recorded as soon as a wait on it is enqueued.
class EventPool {
 public:
  explicit EventPool(int device_count);
  ~EventPool();
  cudaEvent_t acquire(int device);
  void release(int device, cudaEvent_t e) noexcept;

 private:
  struct PerDevice {
    std::mutex mu;
    std::vector<cudaEvent_t> free;
  };
  std::vector<std::unique_ptr<PerDevice>> devices_;
};

// Where a device's memory is (Note [Device memory breakdown] in core/backend.h),
// as the allocator sees it.
struct AllocatorMemory {
  size_t in_use = 0;          // bytes_in_use()
  size_t graph_raw = 0;       // the graphs' segments
  size_t graph_retained = 0;  // blocks from the stream-ordered pool the graphs keep
  size_t graph_counted = 0;   // what the graphs add to in_use (live blocks, free bytes, retained)
  size_t cached = 0;          // the front cache
  size_t pool_reserved = 0;   // the stream-ordered pool's reserved bytes
  size_t pool_used = 0;       // of which handed out (live blocks by size class, cached blocks)
};

class CudaAllocator {
 public:
  CudaAllocator(int device_count, EventPool* events);
  CudaAllocator(const CudaAllocator&) = delete;
  CudaAllocator& operator=(const CudaAllocator&) = delete;

  // nbytes == 0 gives nullptr. Throws OutOfMemoryError after one retry with the
  // cache released and the pool trimmed.
  void* allocate(size_t nbytes, int device);
  void deallocate(void* ptr, int device) noexcept;
  // `stream` (on device `user`) reads or writes the block of `owner` that
  // contains `ptr`: freeing the block will wait for all the work enqueued on
  // `stream` until then, whether before or after this call. Pointers this
  // allocator did not hand out are ignored.
  void record_use(const void* ptr, int owner, int user, cudaStream_t stream);
  // Called before cudaStreamDestroy(stream) (Note [Freeing across streams]):
  // also frees the blocks cached on `stream` (Note [Allocator front cache]).
  void stream_destroyed(int device, cudaStream_t stream);
  // Returns every block cached on `device` to the pool (cudaFreeAsync on the
  // stream it was cached on). The pool keeps the memory reserved.
  void release_cached(int device);

  // Note [Graph pools]. begin_capture gives cached memory back to the driver
  // first (it synchronises the device), so the graph's pool can take it.
  struct GraphPool;
  GraphPool* begin_capture(int device);
  void end_capture(int device) noexcept;
  // The graph is gone: the pool's memory is freed once its last block is.
  void release_pool(GraphPool* pool) noexcept;
  size_t graph_pool_bytes(int device) const;
  AllocatorMemory memory(int device) const;

  size_t bytes_in_use(int device) const;
  size_t peak_bytes(int device) const;
  void reset_peak_bytes(int device);
  size_t cached_bytes(int device) const;

  // Note [Allocator front cache]: the largest block that is cached, and the
  // most bytes cached per device (0: 1/8 of the device's memory). Lowering
  // them does not release what is already cached.
  void set_cache_limits(size_t max_block, size_t max_total);
  void set_cache_enabled(bool enabled);
  bool cache_enabled() const { return cache_enabled_.load(std::memory_order_relaxed); }
  // The bytes a block serving an n-byte request has (n <= max_cached_block).
  static size_t size_class(size_t n);

 private:
  // A stream that uses the block. While the stream lives, `stream` is set and
  // `event` is nullptr: the event is recorded when the block is freed. Once
  // the stream is destroyed, `stream` is nullptr and `event` marks its last
  // work (Note [Freeing across streams]).
  struct Use {
    int device;
    cudaStream_t stream;
    cudaEvent_t event;
  };
  struct Block {
    size_t size = 0;              // requested bytes (bytes_in_use counts these)
    size_t capacity = 0;          // its size class when cacheable, else 0
    cudaStream_t home = nullptr;  // nullptr once the stream is destroyed
    std::vector<Use> uses;
    GraphPool* pool = nullptr;    // Note [Graph pools]: the graph's pool it came from
  };
  using BlockMap = std::map<uintptr_t, Block>;  // by start address, for interior pointers
  // A cached block keeps its map node, so that a hit re-inserts it without a
  // heap allocation.
  using CachedBlock = BlockMap::node_type;
  struct StreamCache {
    cudaStream_t stream = nullptr;
    std::unordered_map<size_t, std::vector<CachedBlock>> by_class;  // LIFO per class
  };
  struct DeviceState {
    mutable std::mutex mu;
    BlockMap blocks;  // live blocks
    size_t in_use = 0;
    size_t peak = 0;
    // Note [Allocator front cache]: one entry per stream that freed a block
    // (a handful at most, so a vector).
    std::vector<StreamCache> caches;
    size_t cached = 0;
    size_t default_cap = 0;        // 1/8 of the device's memory, set with the pool
    cudaMemPool_t pool = nullptr;  // configured at first allocation
    cudaMemPool_t persistent = nullptr;  // Note [Persistent allocations], made at first use
    // Note [Graph pools]: the pool of the capture in progress, if any (the
    // flag lets the common path skip the lock), and every unreleased pool.
    std::atomic<bool> capture_active{false};
    GraphPool* capturing = nullptr;
    std::vector<std::unique_ptr<GraphPool>> graph_pools;
  };

  DeviceState& state(int device) const;
  // Note [Graph pools]: an allocation on a capturing stream, or nullptr when
  // `stream` is not being captured.
  void* allocate_captured(DeviceState& st, size_t nbytes, int device, cudaStream_t stream);
  // Note [Persistent allocations] (core/persistent_alloc.h): from the device's
  // persistent pool, exact size (rounded to 512 B), never cached.
  void* allocate_persistent(DeviceState& st, size_t nbytes, int device, cudaStream_t stream);
  cudaMemPool_t persistent_pool(int device, DeviceState& st);
  // After a failed allocation: the cache released, the device synchronised,
  // both pools trimmed (the caller then retries once).
  void free_everything_unused(int device, DeviceState& st);
  // Under st.mu: a block of `carved` bytes for an `nbytes` request from the
  // pool's free ranges of `stream`, or nullptr when none fits.
  void* carve_locked(DeviceState& st, GraphPool* gp, size_t nbytes, size_t carved, cudaStream_t stream);
  // Under st.mu: frees the pool's memory when it is released and unused;
  // returns the pointers to cudaFree (outside the lock).
  std::vector<void*> take_if_dead_locked(DeviceState& st, GraphPool* gp);
  static void free_pool_memory(int device, const std::vector<void*>& ptrs) noexcept;
  cudaMemPool_t pool(int device, DeviceState& st);
  [[noreturn]] void throw_oom(size_t nbytes, int device, const DeviceState& st) const;
  // Under st.mu: takes a cached block of `cls` bytes for `stream`, or returns
  // an empty handle.
  CachedBlock take_cached_locked(DeviceState& st, cudaStream_t stream, size_t cls);
  // Under st.mu: caches `node` (freed on `stream`, its waits enqueued) when the
  // caps allow; false leaves `node` to the caller.
  bool cache_locked(DeviceState& st, cudaStream_t stream, CachedBlock& node);
  // Takes every cached block of `st` (of one stream when `only` is set) out of
  // the cache, under st.mu.
  std::vector<std::pair<cudaStream_t, CachedBlock>> drain_locked(DeviceState& st, cudaStream_t only);
  void free_to_pool(int device, const std::vector<std::pair<cudaStream_t, CachedBlock>>& blocks) noexcept;

  std::vector<std::unique_ptr<DeviceState>> devices_;
  EventPool* events_;
  std::atomic<bool> cache_enabled_;
  bool persistent_enabled_;  // CHORUS_CUDA_PERSISTENT_POOL
  std::atomic<size_t> max_cached_block_;
  std::atomic<size_t> max_cached_total_;  // 0: 1/8 of the device's memory
};

struct CudaAllocator::GraphPool {
  int device = 0;
  // Its segments, carved per stream (Note [Graph pools]): requests of up to
  // kSmallRequest bytes in `small`, the rest in `large`.
  chorus::detail::RangeArena small{0}, large{size_t{1} << 20};
  std::vector<void*> raw;       // every segment it cudaMalloc'ed
  std::vector<void*> retained;  // blocks from outside freed by the capture
  size_t raw_bytes = 0;         // of the segments
  size_t retained_bytes = 0;
  size_t live = 0;              // its blocks in use
  size_t live_bytes = 0;        // their requested bytes
  size_t held = 0;              // its free bytes and retained blocks: still counted in
                                // bytes_in_use, as the graph owns them
  bool released = false;        // the graph is gone
  static constexpr size_t kSmallRequest = size_t{1} << 20;
  chorus::detail::RangeArena& arena(size_t carved) { return carved <= kSmallRequest ? small : large; }
};

// "1.50 GiB": byte counts for messages.
std::string format_bytes(double bytes);

}  // namespace chorus::cuda
