// The CPU backend: host memory, and "streams" that are the issuing thread
// itself. Every CPU op is synchronous, so events only carry a timestamp.
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/core/host_cache.h"

namespace chorus {

namespace {

struct CpuEvent {
  std::chrono::steady_clock::time_point t;
};

class CpuBackend final : public DeviceBackend {
 public:
  DeviceType type() const override { return DeviceType::CPU; }
  int device_count() const override { return cpu_device_count(); }

  void* allocate(size_t nbytes, Device d) override {
    // 64-byte alignment for vector loads; aligned_alloc needs a multiple of it.
    size_t n = ((nbytes + 63) / 64) * 64;
    if (n == 0) n = 64;
    // A 64-byte header before the block remembers its size (what bytes_in_use
    // counts) and the block's own size (what the host cache takes back).
    size_t block_size = 0;
    void* base = detail::host_alloc(n + 64, &block_size);
    if (!base) {
      CHORUS_THROW(OutOfMemoryError, "out of memory on ", d.str(), ": could not allocate ",
                   nbytes, " bytes (", counters(d).in_use.load(), " bytes in use by Chorus on it)");
    }
    static_cast<size_t*>(base)[0] = n;
    static_cast<size_t*>(base)[1] = block_size;
    Counters& c = counters(d);
    size_t cur = (c.in_use += n);
    size_t pk = c.peak.load();
    while (cur > pk && !c.peak.compare_exchange_weak(pk, cur)) {}
    return static_cast<char*>(base) + 64;
  }
  void deallocate(void* ptr, Device d) noexcept override {
    if (!ptr) return;
    void* base = static_cast<char*>(ptr) - 64;
    counters(d).in_use -= static_cast<size_t*>(base)[0];
    detail::host_free(base, static_cast<size_t*>(base)[1]);
  }
  size_t bytes_in_use(Device d) const override { return counters(d).in_use.load(); }
  size_t peak_bytes(Device d) const override { return counters(d).peak.load(); }
  void reset_peak_bytes(Device d) override { counters(d).peak.store(counters(d).in_use.load()); }
  // One cache serves every logical CPU device (they share the host's memory).
  size_t cached_bytes(Device) const override { return detail::host_cached_bytes(); }
  void empty_cache(Device) override { detail::host_empty_cache(); }

  void copy(void* dst, Device dst_dev, const void* src, Device src_dev, size_t n) override {
    CHORUS_ASSERT(dst_dev.is_cpu() && src_dev.is_cpu());
    if (n) std::memmove(dst, src, n);
  }
  void synchronize(Device) override {}

  StreamHandle current_stream(Device) override { return nullptr; }
  void set_current_stream(Device, StreamHandle) override {}
  StreamHandle create_stream(Device) override { return nullptr; }
  void destroy_stream(Device, StreamHandle) noexcept override {}
  void synchronize_stream(Device, StreamHandle) override {}
  EventHandle create_event(Device, bool) override { return new CpuEvent{}; }
  void destroy_event(Device, EventHandle e) noexcept override { delete static_cast<CpuEvent*>(e); }
  void record_event(Device, EventHandle e, StreamHandle) override {
    static_cast<CpuEvent*>(e)->t = std::chrono::steady_clock::now();
  }
  void stream_wait_event(Device, StreamHandle, EventHandle) override {}
  void synchronize_event(Device, EventHandle) override {}
  bool event_query(Device, EventHandle) override { return true; }
  float event_elapsed_ms(Device, EventHandle a, EventHandle b) override {
    auto d = static_cast<CpuEvent*>(b)->t - static_cast<CpuEvent*>(a)->t;
    return std::chrono::duration<float, std::milli>(d).count();
  }
  std::string device_name(Device d) const override { return "CPU (logical device " + d.str() + ")"; }

 private:
  // Per logical device, so that a pipeline's stages on cpu:0 and cpu:1 report
  // their own peaks (a storage is freed on the device it was allocated on).
  struct Counters {
    std::atomic<size_t> in_use{0};
    std::atomic<size_t> peak{0};
  };
  Counters& counters(Device d) const {
    const size_t i = d.index >= 0 && d.index < kMaxCpuDevices ? static_cast<size_t>(d.index) : 0;
    return counters_[i];
  }
  mutable Counters counters_[kMaxCpuDevices];
};

}  // namespace

std::unique_ptr<DeviceBackend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace chorus
