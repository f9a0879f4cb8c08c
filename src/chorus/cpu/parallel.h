// parallel_for: splits [0, n) into chunks run on a small persistent thread
// pool. Results never depend on the number of threads: callers partition only
// independent work (no reductions across chunks).
#pragma once

#include <cstdint>
#include <functional>

namespace chorus::cpu {

// Number of threads a parallel_for splits its work over (CHORUS_NUM_THREADS,
// default: hardware threads; set_num_threads changes it).
int num_threads();

// Sets num_threads() and OpenBLAS's thread count for the rest of the process
// (n >= 1). Safe at any time: work is split into chunks claimed by whichever
// threads are there, so the pool needs no restart.
void set_num_threads(int n);

// True when CHORUS_NUM_THREADS is set: the user's choice, which automatic
// settings (the Gloo process group's share of the cores) leave alone.
bool num_threads_set_by_user();

// Calls fn(begin, end) on disjoint ranges covering [0, n). Runs inline when n
// is below `grain` or when called from inside a worker (no nested fan-out).
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace chorus::cpu
