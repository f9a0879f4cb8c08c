// A default-on switch for one of the convolution's alternative kernel paths
// (the GEMM path, the direct kernels, the tensor-core kernel). Include only
// from src/chorus/cuda.
#pragma once

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "chorus/core/env_switches.h"

namespace chorus::cuda {

// On unless the environment variable `env` is "0" when first asked; tests
// turn it on and off (set), which wins over the environment from then on.
class PathSwitch {
 public:
  explicit PathSwitch(const char* env) : env_(env) {}
  bool on() {
    int v = state_.load(std::memory_order_relaxed);
    if (v < 0) {
      const char* e = chorus::env::get(env_);
      v = e && *e && std::strcmp(e, "0") == 0 ? 0 : 1;
      int unset = -1;
      if (!state_.compare_exchange_strong(unset, v, std::memory_order_relaxed)) v = unset;
    }
    return v != 0;
  }
  void set(bool on) { state_.store(on ? 1 : 0, std::memory_order_relaxed); }

 private:
  const char* env_;
  std::atomic<int> state_{-1};
};

}  // namespace chorus::cuda
