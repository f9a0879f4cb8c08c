// DeviceBackend: the one virtual interface between device-independent code and a
// kind of device (as PyTorch's DeviceGuardImplInterface). The CPU backend is a
// thin, synchronous implementation; the CUDA backend (src/chorus/cuda) is
// registered when the build has CUDA.
//
// Note [Stream-ordered memory]: allocate() returns memory usable on the current
// stream of the device. When another stream reads it, record_use() tells the
// allocator so that the block is not handed out again before that stream is
// done with it.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>

#include "chorus/core/device.h"

namespace chorus {

// Opaque stream/event handles; nullptr is the device's default stream.
using StreamHandle = void*;
using EventHandle = void*;

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  virtual DeviceType type() const = 0;
  virtual int device_count() const = 0;

  // Memory. allocate throws OutOfMemoryError naming the device, the request and
  // the bytes in use.
  virtual void* allocate(size_t nbytes, Device d) = 0;
  virtual void deallocate(void* ptr, Device d) noexcept = 0;
  // `stream`: the stream of `user` that reads the block; null means the
  // thread's current stream of `user`.
  virtual void record_use(void* ptr, Device owner, Device user, StreamHandle stream = nullptr) {}
  virtual size_t bytes_in_use(Device d) const { return 0; }
  virtual size_t peak_bytes(Device d) const { return 0; }
  virtual void reset_peak_bytes(Device d) {}
  // Memory freed by tensors but kept by the allocator for reuse (CUDA: the
  // allocator's front cache, not counted in bytes_in_use), and its release
  // back to the device's pool (PyTorch's empty_cache).
  virtual size_t cached_bytes(Device d) const { return 0; }
  virtual void empty_cache(Device d) {}
  // The device's free and total memory as its driver reports them (CUDA:
  // cudaMemGetInfo, so memory the pools already hold counts as used), or
  // nullopt where unknown (the CPU: host memory belongs to everything else
  // on the machine too). Memory plans compare with it (data_parallel/memory_plan.h).
  struct MemoryInfo {
    size_t free = 0, total = 0;
  };
  virtual std::optional<MemoryInfo> memory_info(Device d) const { return std::nullopt; }
  // Note [Device memory breakdown]: what the driver counts as used, in four
  // parts that add up to it -- the tensors outside CUDA graphs' pools, the
  // graphs' pools (their segments, whether a replay's temporaries fill them
  // or not), what the allocator keeps beyond the tensors (its front cache,
  // the stream-ordered pool's idle reserve, size-class rounding), and the
  // rest: the context, kernels' modules, cuBLAS's and cuDNN's workspaces,
  // NCCL's buffers. `chorus train` prints it at the end; nullopt where the
  // driver keeps no count (the CPU).
  struct MemoryBreakdown {
    size_t used = 0, total = 0;
    size_t tensors = 0, graph_pools = 0, allocator_kept = 0, other = 0;
    // Of allocator_kept: the front cache (cached_bytes), and the pool's
    // reserve that no block uses (freed memory the pool keeps; the rest is
    // size classes' rounding).
    size_t cached = 0, pool_idle = 0;
  };
  virtual std::optional<MemoryBreakdown> memory_breakdown(Device d) const { return std::nullopt; }
  // Brackets the span an external profiler records (CUDA: cudaProfilerStart/
  // Stop, for `nsys --capture-range=cudaProfilerApi` or `ncu
  // --profile-from-start off`): `chorus bench` with CHORUS_PROFILER_RANGE=1
  // marks its timed steps, so a profile leaves out the plan search and warm-up.
  virtual void profiler_range(bool on) {}

  // Copies nbytes between any two devices (one of which is this backend's, the
  // other may be the host). Ordered after the work already issued to the
  // current streams of both devices; returns without waiting on the host
  // unless the destination is host memory.
  virtual void copy(void* dst, Device dst_dev, const void* src, Device src_dev, size_t nbytes) = 0;

  virtual void synchronize(Device d) = 0;

  // Streams and events.
  virtual StreamHandle current_stream(Device d) = 0;
  virtual void set_current_stream(Device d, StreamHandle s) = 0;
  virtual StreamHandle create_stream(Device d) = 0;
  virtual void destroy_stream(Device d, StreamHandle s) noexcept = 0;
  virtual void synchronize_stream(Device d, StreamHandle s) = 0;
  virtual EventHandle create_event(Device d, bool timing) = 0;
  virtual void destroy_event(Device d, EventHandle e) noexcept = 0;
  virtual void record_event(Device d, EventHandle e, StreamHandle s) = 0;
  virtual void stream_wait_event(Device d, StreamHandle s, EventHandle e) = 0;
  virtual void synchronize_event(Device d, EventHandle e) = 0;
  virtual bool event_query(Device d, EventHandle e) = 0;
  // Milliseconds from `start` to `end`.
  virtual float event_elapsed_ms(Device d, EventHandle start, EventHandle end) = 0;
  // Holds `d`'s current stream until the returned function is called (or is
  // dropped uncalled, which also lets it go after a bound): the work issued in
  // between then runs back to back, so events around it time the device, not
  // the host's issue gaps (Note [Timing behind a gate], cuda/runtime/timing_gate.h).
  // Null where the device has no such thing (CPU: host time is the time).
  virtual std::shared_ptr<void> hold_stream(Device d) { return nullptr; }

  virtual std::string device_name(Device d) const = 0;

  // CUDA graphs (Note [CUDA graphs] in core/graph_capture.h). capture_begin
  // starts recording the work issued to stream `s` of `d` (and to the streams
  // that join it through events), with allocations on those streams served
  // from a pool private to the graph; capture_end stops it and returns the
  // replayable graph, or throws CaptureError with the reason the capture
  // failed. capture_end must follow every capture_begin, also after an
  // exception. Backends without graphs throw CaptureError from capture_begin.
  using GraphHandle = void*;
  virtual void capture_begin(Device d, StreamHandle s);
  virtual GraphHandle capture_end(Device d, StreamHandle s);
  // A capture over several devices: capture_fork makes stream `s` of `d` part
  // of the capture begun on `origin`'s stream `origin_stream` (through an
  // event; `d`'s allocations on captured streams then come from a pool of the
  // same graph), and capture_join orders the end of `origin_stream` after `s`'s
  // work; every forked stream is joined before capture_end.
  virtual void capture_fork(Device d, StreamHandle s, Device origin, StreamHandle origin_stream);
  virtual void capture_join(Device d, StreamHandle s, Device origin, StreamHandle origin_stream);
  // Enqueues one replay on `s` (of the graph's device).
  virtual void graph_replay(Device d, GraphHandle g, StreamHandle s);
  // Frees the graph; its memory goes once the tensors made in it are freed.
  virtual void graph_destroy(Device d, GraphHandle g) noexcept {}
  // Bytes held by the graphs' private pools of `d`.
  virtual size_t graph_pool_bytes(Device d) const { return 0; }
};

// The backend for a device type. Throws DeviceError when the build has no such
// backend (e.g. cuda in a CPU-only build).
DeviceBackend& backend(DeviceType t);
inline DeviceBackend& backend(const Device& d) { return backend(d.type); }
bool has_backend(DeviceType t);
void register_backend(std::unique_ptr<DeviceBackend> b);

// Waits for all work on every device (synchronize()) or on one.
void synchronize();
void synchronize(const Device& d);

}  // namespace chorus
