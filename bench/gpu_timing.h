// Timing GPU calls from a plain bench program (bench/*_gpu.cpp): the timed
// calls are queued behind ~20 ms of matrix products, so the events time the
// GPU, not the host's launch rate.
#pragma once

#include <chorus/chorus.h>

#include "chorus/core/stream.h"

namespace chorus::bench {

// Keeps the GPU busy while the host queues the timed calls.
inline void occupy(const Tensor& a) {
  Tensor x = a;
  for (int i = 0; i < 8; ++i) x = matmul(x, a);
}

// Microseconds per call of `call` (after 3 untimed), queued behind occupy(busy).
template <typename F>
double time_calls(const Device& dev, const Tensor& busy, int iters, F&& call) {
  for (int i = 0; i < 3; ++i) call();
  occupy(busy);
  Event start(dev), stop(dev);
  start.record();
  for (int i = 0; i < iters; ++i) call();
  stop.record();
  stop.synchronize();
  return 1e3 * start.elapsed(stop) / iters;
}

}  // namespace chorus::bench
