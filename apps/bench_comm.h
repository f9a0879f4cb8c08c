// `chorus bench-comm`: all-reduce bus bandwidth through the process group.
#pragma once

#include <string>

namespace CLI {
class App;
}

namespace chorus::app {

struct BenchCommConfig {
  std::string backend = "gloo";
  std::string sizes_mb = "1,16,146,512";
  int iters = 20;
  int warmup = 5;
  double timeout_s = 300;
  bool json = false;
};

void add_bench_comm_options(CLI::App* cmd, BenchCommConfig& c);
int run_bench_comm(const BenchCommConfig& c);

}  // namespace chorus::app
