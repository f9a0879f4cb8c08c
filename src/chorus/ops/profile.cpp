#include "chorus/core/env_switches.h"
#include "chorus/ops/profile.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "chorus/core/backend.h"
#include "chorus/ops/device_trace.h"

namespace chorus::ops {

namespace {
struct Entry {
  double ms = 0;
  int64_t calls = 0;
};
struct Table {
  std::mutex mu;
  std::map<std::string, Entry> rows;
  ~Table() {
    std::vector<std::pair<std::string, Entry>> v(rows.begin(), rows.end());
    std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
    double total = 0;
    for (auto& [k, e] : v) total += e.ms;
    std::fprintf(stderr, "CHORUS_PROFILE: %-40s %10s %8s %6s\n", "kernel (device)", "ms", "calls", "%");
    for (auto& [k, e] : v)
      std::fprintf(stderr, "CHORUS_PROFILE: %-40s %10.2f %8lld %6.1f\n", k.c_str(), e.ms, (long long)e.calls,
                   total > 0 ? 100.0 * e.ms / total : 0.0);
  }
};
Table* table() {
  static Table t;
  return &t;
}
double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
// Note [Step traces] in profile.h.
struct Trace {
  std::atomic<bool> on{false};
  std::atomic<int64_t> step{-1};
  std::mutex mu;
  std::vector<TraceSpan> spans;
  std::thread::id owner;     // the thread that started the trace: the "host" track
  double wall_offset_us = 0;  // system clock minus steady clock at start_trace
  std::atomic<int> next_thread{1};
};
Trace& trace() {
  static Trace* t = new Trace;  // never destroyed: threads may record during exit
  return *t;
}
double steady_us(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::micro>(t.time_since_epoch()).count();
}
std::string host_track() {
  Trace& tr = trace();
  if (std::this_thread::get_id() == tr.owner) return "host";
  thread_local int index = tr.next_thread.fetch_add(1);
  return "host thread " + std::to_string(index);
}
void record(std::string name, const char* category, std::string track, std::chrono::steady_clock::time_point begin,
            std::chrono::steady_clock::time_point end) {
  Trace& tr = trace();
  TraceSpan s{std::move(name), category, std::move(track), steady_us(begin) + tr.wall_offset_us,
              steady_us(end) + tr.wall_offset_us, tr.step.load(std::memory_order_relaxed)};
  std::lock_guard<std::mutex> lock(tr.mu);
  if (tr.on.load(std::memory_order_relaxed)) tr.spans.push_back(std::move(s));
}
}  // namespace

void start_trace() {
  Trace& tr = trace();
  {
    std::lock_guard<std::mutex> lock(tr.mu);
    if (tr.on.load()) return;
    tr.owner = std::this_thread::get_id();
    const double sys = std::chrono::duration<double, std::micro>(std::chrono::system_clock::now().time_since_epoch()).count();
    tr.wall_offset_us = sys - steady_us(std::chrono::steady_clock::now());
    tr.on.store(true);
  }
  // Note [Device tracks]: on the same clock as the host spans.
  start_device_trace([&tr] { return steady_us(std::chrono::steady_clock::now()) + tr.wall_offset_us; });
}

void stop_trace(bool wait_for_devices) {
  Trace& tr = trace();
  tr.on.store(false);
  std::vector<TraceSpan> device = stop_device_trace(wait_for_devices);
  if (device.empty()) return;
  std::lock_guard<std::mutex> lock(tr.mu);
  for (TraceSpan& s : device) tr.spans.push_back(std::move(s));
}

bool tracing() { return trace().on.load(std::memory_order_relaxed); }

void set_trace_step(int64_t step) { trace().step.store(step, std::memory_order_relaxed); }

std::vector<TraceSpan> take_trace() {
  Trace& tr = trace();
  std::lock_guard<std::mutex> lock(tr.mu);
  std::vector<TraceSpan> out;
  out.swap(tr.spans);
  return out;
}

void trace_host_span(const char* name, const char* category, std::chrono::steady_clock::time_point begin,
                     std::chrono::steady_clock::time_point end) {
  if (tracing()) record(name, category, host_track(), begin, end);
}

void trace_span(const std::string& track, const char* name, const char* category,
                std::chrono::steady_clock::time_point begin, std::chrono::steady_clock::time_point end) {
  if (tracing()) record(name, category, track, begin, end);
}

TraceScope::TraceScope(const char* name, const char* category) {
  if (!tracing()) return;
  name_ = name;
  category_ = category;
  begin_ = std::chrono::steady_clock::now();
}

TraceScope::~TraceScope() {
  if (!name_) return;
  try {
    record(name_, category_, host_track(), begin_, std::chrono::steady_clock::now());
  } catch (...) {  // a destructor never throws (std::bad_alloc at worst)
  }
}

bool profiling_enabled() {
  static const bool on = [] {
    const char* e = chorus::env::get("CHORUS_PROFILE");
    return e && *e && std::string(e) != "0";
  }();
  return on;
}

void reset_profile() {
  if (!profiling_enabled()) return;
  Table* t = table();
  std::lock_guard<std::mutex> lock(t->mu);
  t->rows.clear();
}

ProfileScope::ProfileScope(const char* kernel, const Device& d) {
  if (tracing()) {
    traced_ = true;
    kernel_ = kernel;
    device_ = d;
    begin_ = std::chrono::steady_clock::now();
    if (d.is_cuda()) device_trace_saw(d);
  }
  if (!profiling_enabled()) return;
  kernel_ = kernel;
  device_ = d;
  table();  // constructed before any use, so destroyed (and printed) after
  backend(d).synchronize(d);
  start_ = now_ms();
}

ProfileScope::~ProfileScope() {
  if (traced_) {
    try {
      record(kernel_, "kernel", device_.str(), begin_, std::chrono::steady_clock::now());
    } catch (...) {
    }
  }
  if (!kernel_ || !profiling_enabled()) return;
  try {
    backend(device_).synchronize(device_);
  } catch (...) {
    return;
  }
  double ms = now_ms() - start_;
  std::string key = std::string(kernel_) + (device_.is_cuda() ? " (cuda)" : " (cpu)");
  std::lock_guard<std::mutex> g(table()->mu);
  Entry& e = table()->rows[key];
  e.ms += ms;
  ++e.calls;
}

}  // namespace chorus::ops
