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
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

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

class CudaAllocator {
 public:
  CudaAllocator(int device_count, EventPool* events);
  CudaAllocator(const CudaAllocator&) = delete;
  CudaAllocator& operator=(const CudaAllocator&) = delete;

  // nbytes == 0 gives nullptr. Throws OutOfMemoryError after one retry with the
  // pool trimmed.
  void* allocate(size_t nbytes, int device);
  void deallocate(void* ptr, int device) noexcept;
  // `stream` (on device `user`) reads or writes the block of `owner` that
  // contains `ptr`: freeing the block will wait for all the work enqueued on
  // `stream` until then, whether before or after this call. Pointers this
  // allocator did not hand out are ignored.
  void record_use(const void* ptr, int owner, int user, cudaStream_t stream);
  // Called before cudaStreamDestroy(stream) (Note [Freeing across streams]).
  void stream_destroyed(int device, cudaStream_t stream);

  size_t bytes_in_use(int device) const;
  size_t peak_bytes(int device) const;
  void reset_peak_bytes(int device);

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
    size_t size = 0;
    cudaStream_t home = nullptr;  // nullptr once the stream is destroyed
    std::vector<Use> uses;
  };
  struct DeviceState {
    mutable std::mutex mu;
    std::map<uintptr_t, Block> blocks;  // by start address, for interior pointers
    size_t in_use = 0;
    size_t peak = 0;
    cudaMemPool_t pool = nullptr;  // configured at first allocation
  };

  DeviceState& state(int device) const;
  cudaMemPool_t pool(int device, DeviceState& st);
  [[noreturn]] void throw_oom(size_t nbytes, int device, const DeviceState& st) const;

  std::vector<std::unique_ptr<DeviceState>> devices_;
  EventPool* events_;
};

// "1.50 GiB": byte counts for messages.
std::string format_bytes(double bytes);

}  // namespace chorus::cuda
