// `chorus plan`: which layout to train a GPT with on N GPUs (DDP, ZeRO
// stages, dp x tp x pp meshes), from the cost model of plan/cost_model.h, and
// `chorus plan --calibrate FILE`, which measures this device's kernel rates
// (and, under chorus launch with 2+ ranks, the bus bandwidth) for it.
#pragma once

#include <optional>
#include <string>

namespace CLI {
class App;
}

namespace chorus::app {

struct PlanConfig {
  std::string model = "gpt2-xl";  // --calibrate: a comma-separated list
  int64_t gpus = 1, gpus_per_node = 8;
  double nic_gbps = 400;  // one GPU's NIC, gigabits a second
  int64_t batch = 8, seq = 1024;
  std::string precision = "bf16";
  bool recompute = false;
  std::string zero_param_dtype;           // ZeRO rows: the blocks' matrices gathered in bf16 (default under bf16) or fp32
  std::optional<std::string> calibration;  // --calibration FILE
  std::optional<std::string> calibrate;    // --calibrate FILE: measure instead of plan
  std::optional<std::string> devices;      // --calibrate's device (default cuda:0 if present, else cpu)
  std::optional<double> gpu_memory_gib;    // default: the calibrated device's memory
  std::string bus_sizes_mb;                // --calibrate under a launcher (default: by device)
  int warmup = 3, iters = 10;
  int64_t top = 20;
  bool json = false;
};

CLI::App* add_plan_command(CLI::App& app, PlanConfig& c);
int run_plan(const PlanConfig& c);

}  // namespace chorus::app
