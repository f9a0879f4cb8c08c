// `chorus bench-comm`: all-reduce bus bandwidth through the process group
// (nccl-tests' definition: algbw = bytes / time, busbw = algbw * 2(n-1)/n),
// one row per message size, printed by rank 0. Run under a launcher:
//   chorus launch --nproc-per-node 2 -- chorus bench-comm --backend nccl
#include "bench_comm.h"

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <sstream>

#include <nlohmann/json.hpp>

#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/distributed/bus_bandwidth.h"
#include "chorus/distributed/init.h"
#include "cli_numbers.h"

namespace chorus::app {

void add_bench_comm_options(CLI::App* cmd, BenchCommConfig& c) {
  cmd->add_option("--backend", c.backend, "gloo (CPU tensors) or nccl (one GPU per process)")->capture_default_str();
  cmd->add_option("--sizes-mb", c.sizes_mb, "Message sizes in MiB, e.g. 1,16,146,512")->capture_default_str();
  cmd->add_option("--iters", c.iters, "Timed all-reduces per size")->capture_default_str()->check(CLI::Range(1, 100000));
  cmd->add_option("--warmup", c.warmup, "Untimed all-reduces per size")->capture_default_str()->check(CLI::Range(0, 100000));
  cmd->add_option("--dist-timeout", c.timeout_s, "Seconds before a collective that does not finish is an error")
      ->capture_default_str()->check(real_number(1e6, false, 0.1));
  cmd->add_flag("--json", c.json, "One JSON object per size (rank 0)");
}

int run_bench_comm(const BenchCommConfig& c) {
  CHORUS_CHECK(c.backend == "gloo" || c.backend == "nccl", "--backend must be gloo or nccl, got '", c.backend, "'");
  std::vector<double> sizes;
  {
    std::stringstream ss(c.sizes_mb);
    std::string item;
    while (std::getline(ss, item, ',')) {
      try {
        size_t used = 0;
        const double mb = std::stod(item, &used);
        CHORUS_CHECK(used == item.size() && mb > 0 && mb <= 65536, "");
        sizes.push_back(mb);
      } catch (const std::exception&) {
        CHORUS_THROW(ValueError, "--sizes-mb: '", item, "' is not a size in MiB (0 < size <= 65536)");
      }
    }
  }
  CHORUS_CHECK(!sizes.empty(), "--sizes-mb is empty: give message sizes in MiB, e.g. --sizes-mb 1,16");
  dist::InitOptions io;
  io.backend = c.backend;
  io.timeout = std::chrono::milliseconds(static_cast<int64_t>(c.timeout_s * 1000));
  dist::ProcessGroupPtr pg = dist::init_process_group(io);
  const Device dev = c.backend == "nccl" ? current_device() : cpu_device(0);
  const int n = pg->size();
  if (pg->rank() == 0 && !c.json)
    std::printf("all-reduce (%s, %d ranks, float32 sum)\n%10s %12s %12s %12s\n", c.backend.c_str(), n, "MiB", "time us",
                "algbw GB/s", "busbw GB/s");
  for (double mb : sizes) {
    const int64_t bytes = static_cast<int64_t>(mb * (1 << 20)) / 4 * 4;
    const double dt = dist::time_all_reduce(*pg, dev, bytes, c.warmup, c.iters);
    const double algbw = static_cast<double>(bytes) / dt / 1e9;
    const double busbw = dist::all_reduce_busbw(bytes, dt, n) / 1e9;
    if (pg->rank() != 0) continue;
    if (c.json) {
      nlohmann::ordered_json row = {{"backend", c.backend}, {"ranks", n}, {"mb", mb}, {"us", dt * 1e6},
                                    {"algbw_GBs", algbw}, {"busbw_GBs", busbw}};
      std::printf("%s\n", row.dump().c_str());
    } else {
      std::printf("%10.1f %12.1f %12.1f %12.1f\n", mb, dt * 1e6, algbw, busbw);
    }
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace chorus::app
