// `chorus bench --strategy ddp,zero-1,...`: DistributedDataParallel and
// ShardedDataParallel throughput of the image models. The
// command launches its own processes for each device count (one per device,
// through chorus launch's machinery, on a free local port); each process is a
// worker (--ddp-worker) that times the same steps as the other strategies and
// rank 0 hands its row back through a file. Every rank takes the device of
// its local rank in --devices (cuda:0,cuda:1: rank 1 on cuda:1).
#pragma once

#include <vector>

#include <nlohmann/json.hpp>

#include "bench.h"
#include "chorus/core/device.h"

namespace chorus::app {

// One row of `strategy` (ddp or zero-N) for `n` processes over the first n
// of `devices` (the launcher side).
nlohmann::ordered_json bench_ddp_row(const BenchConfig& c, const std::string& strategy,
                                     const std::vector<Device>& devices, int64_t n);
// The worker side: times the steps on this rank, writes rank 0's row to
// $CHORUS_BENCH_ROW. Returns the exit code.
int run_bench_ddp_worker(const BenchConfig& c);

}  // namespace chorus::app
