// Timing all-reduces through a process group: what `chorus bench-comm`
// prints and what `chorus plan --calibrate` fits its links to.
#pragma once

#include <cstdint>

#include "chorus/core/device.h"
#include "chorus/dist/process_group.h"

namespace chorus::dist {

// Seconds per float32 all-reduce (sum) of `bytes` on `device` over `pg`:
// `warmup` untimed, a barrier, then `iters` timed back to back. Every rank
// must call it with the same arguments.
double time_all_reduce(ProcessGroup& pg, const Device& device, int64_t bytes, int warmup, int iters);

// nccl-tests' bus bandwidth of an all-reduce: bytes / seconds x 2(n-1)/n.
double all_reduce_busbw(int64_t bytes, double seconds, int ranks);

}  // namespace chorus::dist
