// A kernel timeline without Nsight Systems: a CUDA injection library that
// records every kernel's, copy's and memset's start and end through CUPTI's
// activity API (decoded by src/chorus/cuda/runtime/cupti_activity.cpp, which the
// library's --trace uses too) and writes them as CSV when the process exits. The 2-GPU machines we are lent have no
// nsys, and what limits a multi-GPU step (a tail of communication after the
// backward, compute slowed by NCCL's kernels, a rank waiting for the other)
// only shows on a timeline. Used by scripts/gpu_check.sh's `ddpprof` stage:
//
//   CUDA_INJECTION64_PATH=build-gpu/libchorus_kernel_trace.so \
//   CHORUS_KERNEL_TRACE=out/trace chorus bench ...   # writes out/trace.<pid>.csv
//
// The CUDA driver loads the library at its initialisation in every process
// that has the variable (each rank of a launched job) and calls
// InitializeInjection. Recording follows cudaProfilerStart/Stop
// (CHORUS_PROFILER_RANGE=1 brackets a bench's timed steps); with
// CHORUS_KERNEL_TRACE_ALL=1 it runs from the start. Kernels replayed from a
// CUDA graph are recorded one by one. The CSV's columns are those of
// `nsys stats --report cuda_gpu_trace` that scripts/gpu_timeline.py reads.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include <unistd.h>

#include "chorus/cuda/runtime/cupti_activity.h"  // compiled into this library (CMakeLists.txt)

namespace {

namespace cuda = chorus::cuda;

std::mutex g_mu;
FILE* g_out = nullptr;
std::atomic<bool> g_recording{false};
CUpti_SubscriberHandle g_subscriber = nullptr;

void report(const std::string& failure) {
  if (!failure.empty()) std::fprintf(stderr, "chorus kernel trace: %s\n", failure.c_str());
}
void check(CUptiResult r, const char* what) { report(cuda::cupti_failure(r, what)); }

// Names are written quoted, with any quote doubled (CSV).
void write_name(FILE* f, const char* name) {
  std::fputc('"', f);
  for (const char* p = name ? name : "?"; *p; ++p) {
    if (*p == '"') std::fputc('"', f);
    std::fputc(*p, f);
  }
  std::fputc('"', f);
}

void write_row(uint64_t start, uint64_t end, uint32_t device, uint32_t stream, const char* name) {
  std::fprintf(g_out, "%llu,%llu,%u,%u,", static_cast<unsigned long long>(start),
               static_cast<unsigned long long>(end - start), device, stream);
  write_name(g_out, name);
  std::fputc('\n', g_out);
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  {
    std::lock_guard<std::mutex> lk(g_mu);
    if (g_out) {
      cuda::decode_activity_buffer(buffer, valid, [](const cuda::ActivityRecord& r) {
        // The names scripts/gpu_timeline.py reads.
        std::string name;
        if (r.kind == cuda::ActivityRecord::kMemset) name = "memset " + std::to_string(r.bytes) + " B";
        else if (r.kind == cuda::ActivityRecord::kMemcpy && r.copy_kind < 0)
          name = "memcpy peer " + std::to_string(r.bytes) + " B to device " + std::to_string(r.dst_device);
        else if (r.kind == cuda::ActivityRecord::kMemcpy)
          name = "memcpy kind " + std::to_string(r.copy_kind) + " " + std::to_string(r.bytes) + " B";
        write_row(r.start_ns, r.end_ns, r.device, r.stream, r.kind == cuda::ActivityRecord::kKernel ? r.name : name.c_str());
      });
    }
    size_t dropped = 0;
    if (cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped) == CUPTI_SUCCESS && dropped > 0)
      std::fprintf(stderr, "chorus kernel trace: %zu records dropped\n", dropped);
  }
  std::free(buffer);
}

void start_recording() {
  if (g_recording.exchange(true)) return;
  report(cuda::enable_activity(true));
}

void stop_recording() {
  if (!g_recording.exchange(false)) return;
  report(cuda::enable_activity(false));
  check(cuptiActivityFlushAll(1), "cuptiActivityFlushAll");
}

// cudaProfilerStart/Stop switch the recording on and off.
void CUPTIAPI on_api(void*, CUpti_CallbackDomain domain, CUpti_CallbackId id, const void* data) {
  const auto* info = static_cast<const CUpti_CallbackData*>(data);
  if (domain != CUPTI_CB_DOMAIN_RUNTIME_API || info->callbackSite != CUPTI_API_EXIT) return;
  if (id == CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStart_v4000) start_recording();
  if (id == CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStop_v4000) stop_recording();
}

void finish() {
  stop_recording();
  check(cuptiActivityFlushAll(1), "cuptiActivityFlushAll");
  std::lock_guard<std::mutex> lk(g_mu);
  if (g_out) std::fclose(g_out);
  g_out = nullptr;
}

}  // namespace

extern "C" int InitializeInjection(void) {
  const char* prefix = std::getenv("CHORUS_KERNEL_TRACE");
  if (!prefix || !*prefix) {
    std::fprintf(stderr, "chorus kernel trace: CHORUS_KERNEL_TRACE (an output prefix) is not set; not tracing\n");
    return 1;
  }
  const std::string path = std::string(prefix) + "." + std::to_string(getpid()) + ".csv";
  g_out = std::fopen(path.c_str(), "w");
  if (!g_out) {
    std::fprintf(stderr, "chorus kernel trace: cannot write %s: %s\n", path.c_str(), std::strerror(errno));
    return 1;
  }
  std::fprintf(g_out, "Start (ns),Duration (ns),Device,Strm,Name\n");
  check(cuptiActivityRegisterCallbacks(cuda::activity_buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks");
  check(cuptiSubscribe(&g_subscriber, on_api, nullptr), "cuptiSubscribe");
  check(cuptiEnableCallback(1, g_subscriber, CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStart_v4000),
        "cuptiEnableCallback(cudaProfilerStart)");
  check(cuptiEnableCallback(1, g_subscriber, CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStop_v4000),
        "cuptiEnableCallback(cudaProfilerStop)");
  const char* all = std::getenv("CHORUS_KERNEL_TRACE_ALL");
  if (all && std::strcmp(all, "1") == 0) start_recording();
  std::atexit(finish);
  return 1;
}
