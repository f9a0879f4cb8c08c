#include "chorus/dist/bus_bandwidth.h"

#include <chrono>

#include "chorus/core/backend.h"
#include "chorus/ops/factory.h"

namespace chorus::dist {

double time_all_reduce(ProcessGroup& pg, const Device& device, int64_t bytes, int warmup, int iters) {
  Tensor t = randn({bytes / 4}, TensorOptions(kFloat32, device));
  for (int i = 0; i < warmup; ++i) pg.all_reduce(t)->wait();
  synchronize(device);
  pg.barrier()->wait();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) pg.all_reduce(t)->wait();
  synchronize(device);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
}

double all_reduce_busbw(int64_t bytes, double seconds, int ranks) {
  return static_cast<double>(bytes) / seconds * 2.0 * (ranks - 1) / ranks;
}

}  // namespace chorus::dist
