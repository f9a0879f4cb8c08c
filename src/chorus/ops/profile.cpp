#include "chorus/ops/profile.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "chorus/core/backend.h"

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
}  // namespace

bool profiling_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("CHORUS_PROFILE");
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
  if (!profiling_enabled()) return;
  kernel_ = kernel;
  device_ = d;
  table();  // constructed before any use, so destroyed (and printed) after
  backend(d).synchronize(d);
  start_ = now_ms();
}

ProfileScope::~ProfileScope() {
  if (!kernel_) return;
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
