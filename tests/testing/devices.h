// Logical CPU devices for multi-device tests (DataParallel, pipelines,
// SyncBatchNorm): cpu:0 .. cpu:n-1.
#pragma once

#include <vector>

#include "chorus/core/device.h"

namespace chorus::test {

inline std::vector<Device> cpus(int n) {
  std::vector<Device> out;
  for (int i = 0; i < n; ++i) out.push_back(cpu_device(i));
  return out;
}

}  // namespace chorus::test
