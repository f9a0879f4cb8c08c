// parallel_for: splits [0, n) into chunks run on a small persistent thread
// pool. Results never depend on the number of threads: callers partition only
// independent work (no reductions across chunks).
#pragma once

#include <cstdint>
#include <functional>

namespace chorus::cpu {

// Number of worker threads (CHORUS_NUM_THREADS, default: hardware threads).
int num_threads();

// Calls fn(begin, end) on disjoint ranges covering [0, n). Runs inline when n
// is below `grain` or when called from inside a worker (no nested fan-out).
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace chorus::cpu
