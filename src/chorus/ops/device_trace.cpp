#include "chorus/ops/device_trace.h"

#include <atomic>
#include <cstdio>
#include <mutex>

#if defined(CHORUS_WITH_CUPTI)
#include <cuda_runtime.h>
#include <cxxabi.h>

#include <cstdlib>
#include <cctype>
#include <map>
#include <set>
#include <memory>
#include <utility>

#include "chorus/cuda/runtime/context.h"
#include "chorus/cuda/runtime/cupti_activity.h"
#endif

namespace chorus::ops {

namespace {

struct NamedStream {
  int device = 0;
  void* stream = nullptr;
  std::string name;
};

#if defined(CHORUS_WITH_CUPTI)
// One activity record, its name copied out of CUPTI's buffer.
struct DeviceRecord {
  cuda::ActivityRecord::Kind kind;
  uint64_t start_ns, end_ns;
  uint32_t device, stream;
  std::string name;
};
#endif

struct DeviceTraceState {
  std::mutex mu;
  std::vector<NamedStream> named;  // streams live as long as the process (Note [Current stream])
#if defined(CHORUS_WITH_CUPTI)
  std::vector<DeviceRecord> records;
  bool registered = false, unavailable = false;
  std::atomic<bool> on{false};
  std::atomic<uint64_t> seen{0};  // devices a traced kernel was launched on, a bit each
  double offset_us = 0;           // the trace's clock minus CUPTI's
#endif
};

DeviceTraceState& device_state() {
  static auto* s = new DeviceTraceState;  // never destroyed: CUPTI's thread may deliver during exit
  return *s;
}

#if defined(CHORUS_WITH_CUPTI)
std::string bytes_label(uint64_t b) {
  char buf[48];
  if (b >= (1u << 20)) std::snprintf(buf, sizeof buf, "%.1f MB", static_cast<double>(b) / (1 << 20));
  else if (b >= 1024) std::snprintf(buf, sizeof buf, "%.1f kB", static_cast<double>(b) / 1024);
  else std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(b));
  return buf;
}

std::string demangled(const std::string& name) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> d(abi::__cxa_demangle(name.c_str(), nullptr, nullptr, &status), std::free);
  return status == 0 && d ? std::string(d.get()) : name;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  DeviceTraceState& st = device_state();
  {
    std::lock_guard<std::mutex> lk(st.mu);
    cuda::decode_activity_buffer(buffer, valid, [&](const cuda::ActivityRecord& r) {
      std::string name;
      if (r.kind == cuda::ActivityRecord::kKernel) name = r.name ? r.name : "?";
      else if (r.kind == cuda::ActivityRecord::kMemset) name = "memset " + bytes_label(r.bytes);
      else name = std::string("memcpy ") + cuda::copy_kind_name(r.copy_kind) + " " + bytes_label(r.bytes);
      st.records.push_back({r.kind, r.start_ns, r.end_ns, r.device, r.stream, std::move(name)});
    });
  }
  std::free(buffer);
}

void unavailable(DeviceTraceState& st, const std::string& why) {
  st.unavailable = true;
  std::fprintf(stderr, "chorus: --trace records no device tracks: %s\n", why.c_str());
}
#endif

}  // namespace

bool device_trace_built() {
#if defined(CHORUS_WITH_CUPTI)
  return true;
#else
  return false;
#endif
}

void name_trace_stream(const Device& device, void* stream, const std::string& name) {
  DeviceTraceState& st = device_state();
#if defined(CHORUS_WITH_CUPTI)
  // Work on it during a trace: the device is synchronised before the trace stops.
  if (st.on.load(std::memory_order_relaxed) && device.is_cuda() && device.index >= 0 && device.index < 64)
    st.seen.fetch_or(uint64_t{1} << device.index, std::memory_order_relaxed);
#endif
  std::lock_guard<std::mutex> lk(st.mu);
  for (const NamedStream& n : st.named)
    if (n.device == device.index && n.stream == stream) return;  // the first name stays
  st.named.push_back({device.index, stream, name});
}

void start_device_trace(const std::function<double()>& trace_now_us) {
#if defined(CHORUS_WITH_CUPTI)
  DeviceTraceState& st = device_state();
  if (st.on.load() || cuda_device_count() == 0) return;
  {
    std::lock_guard<std::mutex> lk(st.mu);
    if (st.unavailable) return;
    if (!st.registered) {
      st.registered = true;
      const std::string f = cuda::cupti_failure(
          cuptiActivityRegisterCallbacks(cuda::activity_buffer_requested, buffer_completed),
          "cuptiActivityRegisterCallbacks");
      if (!f.empty()) return unavailable(st, f);
    }
    st.records.clear();
  }
  st.seen.store(0);
  if (const std::string f = cuda::enable_activity(true); !f.empty()) {
    (void)cuda::enable_activity(false);  // the kinds that did start
    std::lock_guard<std::mutex> lk(st.mu);
    return unavailable(st, f);
  }
  // The offset between the clocks: the middle of the tightest of a few
  // bracketing reads of the trace's clock around one of CUPTI's.
  double best = 1e300;
  for (int i = 0; i < 5; ++i) {
    const double a = trace_now_us();
    uint64_t c = 0;
    if (cuptiGetTimestamp(&c) != CUPTI_SUCCESS) continue;
    const double b = trace_now_us();
    if (b - a < best) {
      best = b - a;
      st.offset_us = (a + b) / 2 - static_cast<double>(c) / 1000.0;
    }
  }
  st.on.store(true);
#else
  (void)trace_now_us;
#endif
}

void device_trace_saw(const Device& device) {
#if defined(CHORUS_WITH_CUPTI)
  DeviceTraceState& st = device_state();
  if (!st.on.load(std::memory_order_relaxed) || !device.is_cuda() || device.index < 0 || device.index >= 64) return;
  const uint64_t bit = uint64_t{1} << device.index;
  if (st.seen.load(std::memory_order_relaxed) & bit) return;
  if (st.seen.fetch_or(bit) & bit) return;
  // The stream this thread launches the trace's kernels on: the compute stream.
  name_trace_stream(device, cuda::current_stream(device.index), "compute stream");
#else
  (void)device;
#endif
}

std::vector<TraceSpan> stop_device_trace(bool wait_for_devices) {
  std::vector<TraceSpan> out;
#if defined(CHORUS_WITH_CUPTI)
  DeviceTraceState& st = device_state();
  if (!st.on.exchange(false)) return out;
  const uint64_t seen = st.seen.load();
  if (wait_for_devices) {
    for (int d = 0; d < 64; ++d) {
      if (!(seen & (uint64_t{1} << d))) continue;
      int prev = -1;
      (void)cudaGetDevice(&prev);
      if (cudaSetDevice(d) == cudaSuccess) (void)cudaDeviceSynchronize();
      if (prev >= 0) (void)cudaSetDevice(prev);
    }
  }
  if (const std::string f = cuda::enable_activity(false); !f.empty())
    std::fprintf(stderr, "chorus: --trace: %s\n", f.c_str());
  // Not under st.mu: the buffers are delivered to buffer_completed, which takes it.
  (void)cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  std::vector<DeviceRecord> records;
  std::vector<NamedStream> named;
  {
    std::lock_guard<std::mutex> lk(st.mu);
    records.swap(st.records);
    named = st.named;
  }
  std::map<std::pair<uint32_t, uint32_t>, std::string> stream_name;  // (device, CUPTI stream id)
  for (const NamedStream& n : named) {
    uint32_t id = 0;
    if (cuptiGetStreamIdEx(nullptr, static_cast<CUstream>(n.stream), 0, &id) == CUPTI_SUCCESS)
      stream_name.emplace(std::make_pair(static_cast<uint32_t>(n.device), id), n.name);
  }
  std::map<std::string, std::string> names;  // mangled -> demangled, once each
  out.reserve(records.size());
  for (DeviceRecord& r : records) {
    if (r.start_ns == 0 || r.end_ns < r.start_ns) continue;  // not completed when flushed
    const std::string dev = "cuda:" + std::to_string(r.device);
    TraceSpan s;
    s.start_us = static_cast<double>(r.start_ns) / 1000.0 + st.offset_us;
    s.end_us = static_cast<double>(r.end_ns) / 1000.0 + st.offset_us;
    if (r.kind == cuda::ActivityRecord::kKernel) {
      auto [it, fresh] = names.try_emplace(r.name);
      if (fresh) it->second = demangled(r.name);
      s.name = it->second;
      s.category = s.name.rfind("nccl", 0) == 0 ? "gpu_comm" : "gpu_kernel";
      auto named_it = stream_name.find({r.device, r.stream});
      s.track = dev + (named_it != stream_name.end() ? " " + named_it->second : " stream " + std::to_string(r.stream));
    } else {
      s.name = std::move(r.name);
      s.category = "gpu_copy";
      s.track = dev + " copies";
    }
    out.push_back(std::move(s));
  }
  // A stream no one named that ran NCCL's kernels is a communication track
  // (a CUDA graph's collectives run on streams NCCL makes for the capture):
  // its name says so.
  std::set<std::string> comm_tracks;
  for (const TraceSpan& s : out)
    if (s.category == "gpu_comm" && s.track.find(" stream ") != std::string::npos &&
        std::isdigit(static_cast<unsigned char>(s.track.back())))
      comm_tracks.insert(s.track);
  for (TraceSpan& s : out)
    if (comm_tracks.count(s.track)) s.track += " (nccl)";
#else
  (void)wait_for_devices;
#endif
  return out;
}

}  // namespace chorus::ops
