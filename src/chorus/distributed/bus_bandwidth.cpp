#include "chorus/distributed/bus_bandwidth.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <vector>

#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/core/stream.h"
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

double slowdown_beside_all_reduce(ProcessGroup& pg, const Device& device, const std::function<void()>& work,
                                  int64_t bytes, int iters) {
  CHORUS_CHECK(iters >= 1 && bytes >= 4, "slowdown_beside_all_reduce needs iters >= 1 and bytes >= 4");
  // The work's device time: events on the current stream around it (on a
  // CPU, where the work runs on the calling thread, the wall clock).
  auto device_seconds = [&] {
    if (!device.is_cuda()) {
      const auto t0 = std::chrono::steady_clock::now();
      work();
      synchronize(device);
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    Event start(device), end(device);
    start.record();
    work();
    end.record();
    end.synchronize();
    return static_cast<double>(start.elapsed(end)) * 1e-3;
  };
  work();
  synchronize(device);
  double alone = 0;
  for (int i = 0; i < iters; ++i) alone += device_seconds() / iters;
  // All-reduces to outlast the work twice over, the count agreed on (the
  // largest any rank asks for) so that every rank issues the same ones.
  const double one = time_all_reduce(pg, device, bytes, 1, 3);
  Tensor count = from_vector(std::vector<float>{static_cast<float>(std::ceil(2 * alone / std::max(one, 1e-9)))}, {1},
                             TensorOptions(kFloat32, device));
  pg.all_reduce(count, ReduceOp::Max)->wait();
  const int64_t n = std::clamp<int64_t>(static_cast<int64_t>(count.to_vector<float>()[0]), 1, 4096);
  Tensor buf = randn({bytes / 4}, TensorOptions(kFloat32, device));
  double beside = 0;
  for (int i = 0; i < iters; ++i) {
    synchronize(device);
    pg.barrier()->wait();
    std::vector<WorkPtr> works;
    for (int64_t k = 0; k < n; ++k) works.push_back(pg.all_reduce(buf));
    beside += device_seconds() / iters;
    for (WorkPtr& w : works) w->wait();
  }
  synchronize(device);
  return beside / alone;
}

double all_reduce_busbw(int64_t bytes, double seconds, int ranks) {
  return static_cast<double>(bytes) / seconds * 2.0 * (ranks - 1) / ranks;
}

}  // namespace chorus::dist
