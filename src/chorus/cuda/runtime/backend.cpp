// The CUDA DeviceBackend: memory from CUDA's stream-ordered pools behind a
// per-stream front cache (allocator.h),
// copies ordered with events, and streams/events mapped directly onto
// cudaStream_t / cudaEvent_t.
//
// Note [Copy ordering]: a copy is enqueued on the current stream of the
// destination device (for host<->device copies, of the GPU side). When the
// source is another GPU, an event recorded on the source's current stream
// makes the copy wait for the work that produced the data, and the allocator
// is told that the copy stream reads the source block, so that freeing it
// right after copy() returns is safe. record_use() may come before or after the
// copy is enqueued (ops::to_device calls it again afterwards): the allocator
// remembers the stream and records the event only when the block is freed
// (Note [Freeing across streams] in allocator.h). Only a copy into host memory waits on
// the host, because the caller reads the result next.
//
// A stream handle of nullptr means the calling thread's current stream of the
// device (set_current_stream(d, nullptr) restores the thread's default one).
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/core/graph_capture.h"
#include "chorus/core/warn.h"
#include "chorus/cuda/runtime/timing_gate.h"
#include "chorus/cuda/runtime/allocator.h"
#include "chorus/cuda/runtime/context.h"
#include "chorus/cuda/runtime/graph_memsets.h"

namespace chorus::cuda {

namespace {

int query_device_count() {
  int n = 0;
  // No driver or no GPU (cudaErrorNoDevice, cudaErrorInsufficientDriver, ...)
  // simply means no CUDA devices: CPU-only machines must not see an error.
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

// Pageable host memory cannot be the source of an asynchronous copy, so
// host-to-device copies go through pinned buffers: two per device, used in
// turn in chunks, each with an event that says when the GPU is done reading
// it. The caller may free its source as soon as copy() returns.
class PinnedStaging {
 public:
  static constexpr size_t kChunk = size_t{32} << 20;

  explicit PinnedStaging(int device_count) {
    for (int d = 0; d < device_count; ++d) devices_.push_back(std::make_unique<PerDevice>());
  }
  ~PinnedStaging() {
    for (auto& pd : devices_) {
      for (Slot& s : pd->slots) {
        if (s.buf) (void)cudaFreeHost(s.buf);
        if (s.done) (void)cudaEventDestroy(s.done);
      }
    }
    (void)cudaGetLastError();  // the runtime may already be unloading
  }

  void copy_to_device(void* dst, int device, const void* src, size_t nbytes, cudaStream_t stream) {
    PerDevice& pd = *devices_.at(static_cast<size_t>(device));
    std::lock_guard<std::mutex> g(pd.mu);
    for (size_t off = 0; off < nbytes; off += kChunk) {
      const size_t len = std::min(kChunk, nbytes - off);
      Slot& slot = pd.slots[pd.next];
      pd.next ^= 1;
      if (slot.pending) {
        CHORUS_CUDA_CHECK(cudaEventSynchronize(slot.done));  // its previous copy has read it
        slot.pending = false;
      }
      if (slot.cap < len) {
        if (slot.buf) CHORUS_CUDA_CHECK(cudaFreeHost(slot.buf));
        slot.buf = nullptr;
        slot.cap = 0;
        size_t cap = size_t{64} << 10;
        while (cap < len) cap *= 2;
        CHORUS_CUDA_CHECK(cudaHostAlloc(&slot.buf, cap, cudaHostAllocPortable));
        slot.cap = cap;
      }
      if (!slot.done) CHORUS_CUDA_CHECK(cudaEventCreateWithFlags(&slot.done, cudaEventDisableTiming));
      std::memcpy(slot.buf, static_cast<const char*>(src) + off, len);
      CHORUS_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(dst) + off, slot.buf, len,
                                        cudaMemcpyHostToDevice, stream));
      CHORUS_CUDA_CHECK(cudaEventRecord(slot.done, stream));
      slot.pending = true;
    }
  }

 private:
  struct Slot {
    void* buf = nullptr;
    size_t cap = 0;
    cudaEvent_t done = nullptr;
    bool pending = false;
  };
  struct PerDevice {
    std::mutex mu;
    Slot slots[2];
    int next = 0;
  };
  std::vector<std::unique_ptr<PerDevice>> devices_;
};

// One captured graph: the executable graph and the memory pool it owns
// (Note [Graph pools] in allocator.h).
struct CapturedGraph {
  int device = 0;
  cudaGraphExec_t exec = nullptr;
  std::vector<CudaAllocator::GraphPool*> pools;  // one per device the capture spanned
};

class CudaBackend final : public DeviceBackend {
 public:
  CudaBackend()
      : count_(query_device_count()),
        events_(count_),
        allocator_(count_, &events_),
        staging_(count_),
        capture_pools_(static_cast<size_t>(count_), nullptr) {}

  DeviceType type() const override { return DeviceType::CUDA; }
  int device_count() const override { return count_; }

  // ---- memory ---------------------------------------------------------------
  void* allocate(size_t nbytes, Device d) override { return allocator_.allocate(nbytes, index(d)); }
  void deallocate(void* ptr, Device d) noexcept override {
    allocator_.deallocate(ptr, d.index);
  }
  // Note [Stream-ordered memory]: names the user device's current stream; the
  // free waits for everything enqueued on it until then, before or after this
  // call.
  void record_use(void* ptr, Device owner, Device user, StreamHandle stream) override {
    if (!user.is_cuda() || !ptr) return;  // host reads are synchronous
    allocator_.record_use(ptr, index(owner), index(user),
                          stream ? static_cast<cudaStream_t>(stream) : cuda::current_stream(index(user)));
  }
  size_t bytes_in_use(Device d) const override { return allocator_.bytes_in_use(index(d)); }
  size_t peak_bytes(Device d) const override { return allocator_.peak_bytes(index(d)); }
  void reset_peak_bytes(Device d) override { allocator_.reset_peak_bytes(index(d)); }
  size_t cached_bytes(Device d) const override { return allocator_.cached_bytes(index(d)); }
  void empty_cache(Device d) override { allocator_.release_cached(index(d)); }
  std::optional<MemoryInfo> memory_info(Device d) const override {
    CudaDeviceGuard guard(index(d));
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
      (void)cudaGetLastError();
      return std::nullopt;
    }
    return MemoryInfo{free_b, total_b};
  }
  // Advisory: a profiler that is absent or refuses the range changes nothing.
  void profiler_range(bool on) override {
    if ((on ? cudaProfilerStart() : cudaProfilerStop()) != cudaSuccess) (void)cudaGetLastError();
  }

  void copy(void* dst, Device dst_dev, const void* src, Device src_dev, size_t nbytes) override {
    if (nbytes == 0) return;
    if (dst_dev.is_cpu() && src_dev.is_cpu()) {
      std::memmove(dst, src, nbytes);
    } else if (src_dev.is_cpu()) {
      copy_host_to_device(dst, index(dst_dev), src, nbytes);
    } else if (dst_dev.is_cpu()) {
      const int s = index(src_dev);
      CudaDeviceGuard guard(s);
      cudaStream_t stream = cuda::current_stream(s);
      if (is_capturing(stream)) check_not_capturing("reading a CUDA tensor on the host (item(), to(cpu))");
      CHORUS_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToHost, stream));
      CHORUS_CUDA_CHECK(cudaStreamSynchronize(stream));  // the host reads dst next
    } else if (dst_dev == src_dev) {
      const int d = index(dst_dev);
      CudaDeviceGuard guard(d);
      CHORUS_CUDA_CHECK(
          cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToDevice, cuda::current_stream(d)));
    } else {
      copy_peer(dst, index(dst_dev), src, index(src_dev), nbytes);
    }
  }

  void synchronize(Device d) override {
    check_not_capturing("waiting for the device (synchronize)");
    CudaDeviceGuard guard(index(d));
    CHORUS_CUDA_CHECK(cudaDeviceSynchronize());
  }

  // ---- streams ----------------------------------------------------------------
  StreamHandle current_stream(Device d) override { return cuda::current_stream(index(d)); }
  void set_current_stream(Device d, StreamHandle s) override {
    cuda::set_current_stream(index(d), static_cast<cudaStream_t>(s));
  }
  StreamHandle create_stream(Device d) override {
    CudaDeviceGuard guard(index(d));
    cudaStream_t s;
    CHORUS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    return s;
  }
  void destroy_stream(Device d, StreamHandle s) noexcept override {
    if (!s) return;
    try {
      const int i = index(d);
      auto stream = static_cast<cudaStream_t>(s);
      allocator_.stream_destroyed(i, stream);
      if (cuda::current_stream(i) == stream) cuda::set_current_stream(i, nullptr);
      CudaDeviceGuard guard(i);
      // Returns at once; pending work on the stream still completes.
      CHORUS_CUDA_CHECK(cudaStreamDestroy(stream));
    } catch (const std::exception& e) {
      warnf("destroying a CUDA stream failed: ", e.what());
    }
  }
  void synchronize_stream(Device d, StreamHandle s) override {
    if (is_capturing(stream_of(d, s))) check_not_capturing("waiting for a stream on the host");
    CHORUS_CUDA_CHECK(cudaStreamSynchronize(stream_of(d, s)));
  }

  // ---- events -------------------------------------------------------------------
  EventHandle create_event(Device d, bool timing) override {
    CudaDeviceGuard guard(index(d));
    cudaEvent_t e;
    CHORUS_CUDA_CHECK(
        cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming));
    return e;
  }
  void destroy_event(Device d, EventHandle e) noexcept override {
    if (e && cudaEventDestroy(static_cast<cudaEvent_t>(e)) != cudaSuccess) (void)cudaGetLastError();
  }
  void record_event(Device d, EventHandle e, StreamHandle s) override {
    CudaDeviceGuard guard(index(d));
    CHORUS_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(e), stream_of(d, s)));
  }
  void stream_wait_event(Device d, StreamHandle s, EventHandle e) override {
    CudaDeviceGuard guard(index(d));
    CHORUS_CUDA_CHECK(cudaStreamWaitEvent(stream_of(d, s), static_cast<cudaEvent_t>(e), 0));
  }
  void synchronize_event(Device d, EventHandle e) override {
    CHORUS_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(e)));
  }
  bool event_query(Device d, EventHandle e) override {
    cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(e));
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    CHORUS_CUDA_CHECK(err);
    return true;
  }
  float event_elapsed_ms(Device d, EventHandle start, EventHandle end) override {
    float ms = 0.0f;
    CHORUS_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start),
                                           static_cast<cudaEvent_t>(end)));
    return ms;
  }

  std::shared_ptr<void> hold_stream(Device d) override {
    CudaDeviceGuard guard(index(d));
    // The gate opens when the last holder lets go (its destructor opens it).
    return std::make_shared<cuda::StreamGate>(cuda::current_stream(index(d)));
  }

  // ---- graphs (Note [CUDA graphs]) ------------------------------------------------
  void capture_begin(Device d, StreamHandle s) override {
    const int i = index(d);
    cudaStream_t stream = stream_of(d, s);
    // The stream should be one of the caller's own: every thread issues to the
    // device's default stream (Note [One default stream per device]).
    CudaAllocator::GraphPool* pool = allocator_.begin_capture(i);
    CudaDeviceGuard guard(i);
    // Relaxed: the backward engine's and the allocator's other threads may
    // make calls (cudaMalloc, event queries) a stricter mode forbids.
    cudaError_t err = cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      allocator_.end_capture(i);
      allocator_.release_pool(pool);
      CHORUS_THROW(CaptureError, "cuda:", i, ": starting a graph capture failed: ", cudaGetErrorString(err));
    }
    std::lock_guard<std::mutex> g(capture_mu_);
    capture_pools_[static_cast<size_t>(i)] = pool;
  }

  GraphHandle capture_end(Device d, StreamHandle s) override {
    const int i = index(d);
    cudaStream_t stream = stream_of(d, s);
    CudaDeviceGuard guard(i);
    cudaGraph_t graph = nullptr;
    cudaError_t err = cudaStreamEndCapture(stream, &graph);
    // The pools of the origin and of every device forked into the capture.
    std::vector<CudaAllocator::GraphPool*> pools;
    {
      std::lock_guard<std::mutex> g(capture_mu_);
      for (size_t k = 0; k < capture_pools_.size(); ++k) {
        if (!capture_pools_[k]) continue;
        pools.push_back(std::exchange(capture_pools_[k], nullptr));
        allocator_.end_capture(static_cast<int>(k));
      }
    }
    // The tensors made during a failed capture go back to its pool as they are
    // freed; the pool's memory goes with the last of them.
    auto fail = [&](const char* what, cudaError_t e) {
      (void)cudaGetLastError();
      if (graph) (void)cudaGraphDestroy(graph);
      for (CudaAllocator::GraphPool* p : pools) allocator_.release_pool(p);
      CHORUS_THROW(CaptureError, "cuda:", i, ": ", what, ": ", cudaGetErrorString(e));
    };
    if (err != cudaSuccess || !graph) fail("the graph capture failed", err);
    // Note [Memset nodes in a graph]: cuDNN's small memsets become kernels.
    if (cuda::rewrite_graph_memsets()) {
      try {
        cuda::rewrite_memset_nodes(graph);
      } catch (const Error& e) {
        (void)cudaGraphDestroy(graph);
        for (CudaAllocator::GraphPool* p : pools) allocator_.release_pool(p);
        CHORUS_THROW(CaptureError, "cuda:", i, ": rewriting the graph's memset nodes failed: ", e.what());
      }
    }
    cudaGraphExec_t exec = nullptr;
    // Each kernel node keeps the priority of the stream it was captured from
    // (an NCCL stream of high priority, CHORUS_NCCL_STREAM_PRIORITY): without
    // this flag a replay runs every node at the launching stream's priority.
    err = cudaGraphInstantiate(&exec, graph, cudaGraphInstantiateFlagUseNodePriority);
    if (err != cudaSuccess) fail("instantiating the captured graph failed", err);
    (void)cudaGraphDestroy(graph);
    graph = nullptr;
    err = cudaGraphUpload(exec, stream);
    if (err != cudaSuccess) {
      (void)cudaGraphExecDestroy(exec);
      fail("uploading the captured graph failed", err);
    }
    return new CapturedGraph{i, exec, std::move(pools)};
  }

  void capture_fork(Device d, StreamHandle s, Device origin, StreamHandle origin_stream) override {
    const int i = index(d), o = index(origin);
    CudaAllocator::GraphPool* pool = allocator_.begin_capture(i);
    cudaEvent_t e = events_.acquire(o);
    cudaError_t err;
    {
      CudaDeviceGuard guard(o);
      err = cudaEventRecord(e, stream_of(origin, origin_stream));
    }
    if (err == cudaSuccess) {
      CudaDeviceGuard guard(i);
      err = cudaStreamWaitEvent(stream_of(d, s), e, 0);
    }
    events_.release(o, e);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      allocator_.end_capture(i);
      allocator_.release_pool(pool);
      CHORUS_THROW(CaptureError, "cuda:", i, ": joining the graph capture of cuda:", o, " failed: ",
                   cudaGetErrorString(err));
    }
    std::lock_guard<std::mutex> g(capture_mu_);
    capture_pools_[static_cast<size_t>(i)] = pool;
  }

  void capture_join(Device d, StreamHandle s, Device origin, StreamHandle origin_stream) override {
    const int i = index(d), o = index(origin);
    cudaEvent_t e = events_.acquire(i);
    cudaError_t err;
    {
      CudaDeviceGuard guard(i);
      err = cudaEventRecord(e, stream_of(d, s));
    }
    if (err == cudaSuccess) {
      CudaDeviceGuard guard(o);
      err = cudaStreamWaitEvent(stream_of(origin, origin_stream), e, 0);
    }
    events_.release(i, e);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      CHORUS_THROW(CaptureError, "cuda:", i, ": joining back into the graph capture of cuda:", o, " failed: ",
                   cudaGetErrorString(err));
    }
  }

  void graph_replay(Device d, GraphHandle g, StreamHandle s) override {
    auto* cg = static_cast<CapturedGraph*>(g);
    CudaDeviceGuard guard(cg->device);
    CHORUS_CUDA_CHECK(cudaGraphLaunch(cg->exec, stream_of(d, s)));
  }

  void graph_destroy(Device d, GraphHandle g) noexcept override {
    auto* cg = static_cast<CapturedGraph*>(g);
    if (!cg) return;
    {
      CudaDeviceGuard guard(cg->device);
      if (cudaGraphExecDestroy(cg->exec) != cudaSuccess) (void)cudaGetLastError();
    }
    for (CudaAllocator::GraphPool* p : cg->pools) allocator_.release_pool(p);
    delete cg;
  }

  size_t graph_pool_bytes(Device d) const override { return allocator_.graph_pool_bytes(index(d)); }

  std::optional<MemoryBreakdown> memory_breakdown(Device d) const override {
    std::optional<MemoryInfo> mi = memory_info(d);
    if (!mi) return std::nullopt;
    const AllocatorMemory a = allocator_.memory(index(d));
    // Note [Device memory breakdown]: the stream-ordered pool reserves the
    // tensors outside graphs, the graphs' retained blocks and what the
    // allocator keeps; the graphs' segments and everything else come
    // straight from the driver. Each part is clamped at 0, the rest takes
    // what is left, so the parts add up to `used`.
    auto minus = [](size_t x, size_t y) { return x > y ? x - y : size_t{0}; };
    MemoryBreakdown b;
    b.total = mi->total;
    b.used = mi->total - mi->free;
    b.tensors = minus(a.in_use, a.graph_counted);
    b.graph_pools = a.graph_raw + a.graph_retained;
    b.allocator_kept = std::min(minus(a.pool_reserved, b.tensors + a.graph_retained),
                                minus(b.used, b.tensors + b.graph_pools));
    b.other = minus(b.used, b.tensors + b.graph_pools + b.allocator_kept);
    b.cached = a.cached;
    b.pool_idle = std::min(minus(a.pool_reserved, a.pool_used), b.allocator_kept);
    return b;
  }

  std::string device_name(Device d) const override {
    const cudaDeviceProp& p = device_properties(index(d));
    return std::string(p.name) + " (" + format_bytes(static_cast<double>(p.totalGlobalMem)) + ")";
  }

 private:
  int index(Device d) const {
    CHORUS_CHECK_T(DeviceError, d.is_cuda(), "the CUDA backend was given device ", d.str());
    CHORUS_CHECK_T(DeviceError, d.index >= 0 && d.index < count_, "device ", d.str(),
                   " does not exist: this machine has ", count_, " CUDA device",
                   count_ == 1 ? "" : "s");
    return d.index;
  }
  cudaStream_t stream_of(Device d, StreamHandle s) {
    return s ? static_cast<cudaStream_t>(s) : cuda::current_stream(index(d));
  }

  void copy_host_to_device(void* dst, int d, const void* src, size_t nbytes) {
    CudaDeviceGuard guard(d);
    cudaStream_t stream = cuda::current_stream(d);
    // A replay would copy whatever the host buffer then holds (or freed memory).
    if (is_capturing(stream)) check_not_capturing("copying host memory to a CUDA device (a tensor made on the host)");
    cudaPointerAttributes attr{};
    if (cudaPointerGetAttributes(&attr, src) != cudaSuccess) {
      (void)cudaGetLastError();
      attr.type = cudaMemoryTypeUnregistered;
    }
    if (attr.type == cudaMemoryTypeUnregistered) {
      staging_.copy_to_device(dst, d, src, nbytes, stream);
    } else {
      // Pinned or managed memory: the runtime copies from it asynchronously.
      CHORUS_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, stream));
    }
  }

  // Note [Copy ordering].
  void copy_peer(void* dst, int d, const void* src, int s, size_t nbytes) {
    cudaStream_t src_stream = cuda::current_stream(s);
    cudaStream_t dst_stream = cuda::current_stream(d);
    cudaEvent_t ready = events_.acquire(s);
    {
      CudaDeviceGuard guard(s);
      cudaError_t err = cudaEventRecord(ready, src_stream);
      if (err != cudaSuccess) events_.release(s, ready);
      CHORUS_CUDA_CHECK(err);
    }
    CudaDeviceGuard guard(d);
    cudaError_t err = cudaStreamWaitEvent(dst_stream, ready, 0);
    events_.release(s, ready);  // the wait is enqueued; the event may be reused
    CHORUS_CUDA_CHECK(err);
    const bool peer = peer_access_enabled(d, s);  // direct P2P when the GPUs allow it
    if (peer && is_capturing(dst_stream)) {
      // A stream capture refuses cudaMemcpyPeerAsync (StreamCaptureUnsupported);
      // with peer access a plain copy between the two addresses is the same
      // transfer, and becomes a memcpy node of the graph.
      CHORUS_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, dst_stream));
    } else {
      // cudaMemcpyPeerAsync also works without peer access (through the host).
      CHORUS_CUDA_CHECK(cudaMemcpyPeerAsync(dst, d, src, s, nbytes, dst_stream));
    }
    allocator_.record_use(src, s, d, dst_stream);
  }

  const int count_;
  EventPool events_;
  CudaAllocator allocator_;
  PinnedStaging staging_;
  std::mutex capture_mu_;
  std::vector<CudaAllocator::GraphPool*> capture_pools_;  // of the capture in progress, per device
};

}  // namespace

void register_cuda_backend() { register_backend(std::make_unique<CudaBackend>()); }

}  // namespace chorus::cuda
