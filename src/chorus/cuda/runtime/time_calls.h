// Timing a call on the GPU for a one-off choice between implementations (the
// convolutions' paths in conv.cpp, cuBLASLt's algorithms in blas/gemm_search.cpp).
// Include only from src/chorus/cuda.
#pragma once

#include <type_traits>

#include "chorus/core/device.h"
#include "chorus/core/stream.h"
#include "chorus/cuda/runtime/context.h"
#include "chorus/cuda/runtime/timing_gate.h"

namespace chorus::cuda {

// Milliseconds per call of `run` on `device`'s current stream: one untimed
// call (plan search, module loads: Note [Timing behind a gate] wants a
// kernel's first launch before the gate closes), then `runs` (3) behind a
// gate. A `run` that returns bool says whether it ran; its first false ends
// the timing with -1 (a candidate that cannot run these operands). Blocks the
// host until the runs are done; never call it on a stream being captured.
template <typename Run>
float time_calls(int device, Run&& run, int runs = 3) {
  constexpr bool kReports = std::is_same_v<decltype(run()), bool>;
  auto ran = [&]() -> bool {
    if constexpr (kReports) {
      return run();
    } else {
      run();
      return true;
    }
  };
  if (!ran()) return -1;
  const Device dev(DeviceType::CUDA, device);
  float ms = 0;
  // A gate that gave up before the runs were issued timed the host too: once more.
  for (int attempt = 0; attempt < 2; ++attempt) {
    Event start(dev), stop(dev);
    bool expired = false, ok = true;
    {
      StreamGate gate(current_stream(device));
      start.record();
      for (int i = 0; i < runs && ok; ++i) ok = ran();
      stop.record();
      gate.open();
      stop.synchronize();
      expired = gate.expired();
    }
    if (!ok) return -1;
    ms = start.elapsed(stop) / static_cast<float>(runs);
    if (!expired) break;
  }
  return ms;
}

}  // namespace chorus::cuda
