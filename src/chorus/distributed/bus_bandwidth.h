// Timing all-reduces through a process group: what `chorus bench-comm`
// prints and what `chorus plan --calibrate` fits its links to.
#pragma once

#include <cstdint>
#include <functional>

#include "chorus/core/device.h"
#include "chorus/distributed/process_group.h"

namespace chorus::dist {

// Seconds per float32 all-reduce (sum) of `bytes` on `device` over `pg`:
// `warmup` untimed, a barrier, then `iters` timed back to back. Every rank
// must call it with the same arguments.
double time_all_reduce(ProcessGroup& pg, const Device& device, int64_t bytes, int warmup, int iters);

// How much slower `work` (device work issued on the current stream) runs
// while all-reduces of `bytes` run beside it on the group's stream, as the
// gradients' reduction runs beside DDP's backward: the ratio of its device
// time (events around it) beside them to its time alone, `iters` of each
// after one untimed. Enough all-reduces are issued to outlast the work (the
// same number on every rank: every rank must call it with the same
// arguments).
double slowdown_beside_all_reduce(ProcessGroup& pg, const Device& device, const std::function<void()>& work,
                                  int64_t bytes, int iters);

// nccl-tests' bus bandwidth of an all-reduce: bytes / seconds x 2(n-1)/n.
double all_reduce_busbw(int64_t bytes, double seconds, int ranks);

}  // namespace chorus::dist
