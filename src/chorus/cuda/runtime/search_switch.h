// The switch of a timed search (the convolutions' cuDNN plans, cuBLASLt's GEMM
// algorithms, the fused attention's cuDNN plans). Include only from
// src/chorus/cuda.
#pragma once

#include <atomic>
#include <cstring>

#include "chorus/core/env_switches.h"
#include "chorus/core/error.h"

namespace chorus::cuda {

// CHORUS_..._SEARCH: "timed" or unset searches, "heuristic" takes the
// library's first choice untimed; anything else is an error naming the
// switch. Read from the environment on first use; the setter (tests)
// overrides it, and wins over a read under way.
class SearchSwitch {
 public:
  explicit SearchSwitch(const char* name) : name_(name) {}

  bool heuristic() {
    const int v = state_.load(std::memory_order_relaxed);
    if (v >= 0) return v == 1;
    const char* e = chorus::env::get(name_);
    const bool timed = !e || !*e || std::strcmp(e, "timed") == 0;
    CHORUS_CHECK(timed || std::strcmp(e, "heuristic") == 0, name_, " must be timed or heuristic, got '", e, "'");
    int expected = -1;
    state_.compare_exchange_strong(expected, timed ? 0 : 1);
    return state_.load(std::memory_order_relaxed) == 1;
  }
  void set_heuristic(bool on) { state_.store(on ? 1 : 0); }

 private:
  const char* name_;
  std::atomic<int> state_{-1};  // -1 until read
};

}  // namespace chorus::cuda
