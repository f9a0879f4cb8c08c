// Kernel profiling for finding slow ops: with CHORUS_PROFILE=1 in the
// environment, every kernel-set call through CHORUS_KERNEL synchronises its
// device before and after and adds the time to a per-kernel table printed to
// stderr at exit. Off (one branch per call) otherwise. The synchronisation
// changes the timing of an asynchronous program: use it to rank kernels, not
// to measure throughput.
//
// Note [Step traces]: the same hook also records a timeline. Between
// start_trace() and stop_trace() every CHORUS_KERNEL call is kept as a span on
// its device's track (host time: on a CPU device the kernel's run, on a CUDA
// device its launch), and TraceScope marks host phases (data, forward,
// backward, optimizer, wait_gradients). Nothing synchronises: a trace shows
// where the host spends a step. When no trace is on, each scope costs one
// relaxed atomic load. `chorus train|bench --trace` writes the spans as a
// Chrome trace (io/trace.h). With CUPTI, the trace also holds what the GPUs
// ran (Note [Device tracks] in ops/device_trace.h).
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "chorus/core/device.h"

namespace chorus::ops {

bool profiling_enabled();
// Forgets the times gathered so far (a benchmark calls it after its warm-up,
// so one-off costs such as cuDNN's algorithm search stay out of the table).
void reset_profile();

// One recorded span; times in microseconds since the Unix epoch (the
// system clock at start_trace, advanced by the steady clock), so the spans of
// processes on one machine line up.
struct TraceSpan {
  std::string name;
  std::string category;  // "step", "phase", "kernel", "comm"; "gpu_kernel", "gpu_comm", "gpu_copy" (device tracks)
  std::string track;     // "host" (the thread that started the trace), "host thread N", a device ("cpu:0"), "gloo",
                         // or a device track ("cuda:0 compute stream", "cuda:0 copies")
  double start_us = 0, end_us = 0;
  int64_t step = -1;     // the step being traced when it began
};

void start_trace();
// `wait_for_devices`: synchronise the traced GPUs first, so that their last
// kernels are in the device tracks (not on a path that may follow a failure).
void stop_trace(bool wait_for_devices = false);
bool tracing();
// The step number attached to spans from now on.
void set_trace_step(int64_t step);
// The spans recorded so far (and forgets them).
std::vector<TraceSpan> take_trace();
// Records a span of the calling thread's host track (nothing when no trace is on).
void trace_host_span(const char* name, const char* category, std::chrono::steady_clock::time_point begin,
                     std::chrono::steady_clock::time_point end);

// Records a span on a named track: a communication backend's worker
// ("gloo": its collectives, category "comm").
void trace_span(const std::string& track, const char* name, const char* category,
                std::chrono::steady_clock::time_point begin, std::chrono::steady_clock::time_point end);

// A host phase, from construction to destruction.
class TraceScope {
 public:
  explicit TraceScope(const char* name, const char* category = "phase");
  ~TraceScope();
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

 private:
  const char* name_ = nullptr;
  const char* category_ = nullptr;
  std::chrono::steady_clock::time_point begin_;
};

class ProfileScope {
 public:
  ProfileScope(const char* kernel, const Device& d);
  ~ProfileScope();
  ProfileScope(const ProfileScope&) = delete;
  ProfileScope& operator=(const ProfileScope&) = delete;

 private:
  const char* kernel_ = nullptr;
  Device device_;
  double start_ = 0;
  bool traced_ = false;
  std::chrono::steady_clock::time_point begin_;
};

}  // namespace chorus::ops
