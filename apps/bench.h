// `chorus bench`: training throughput on synthetic data (DESIGN.md's JSON rows).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "chorus/core/device.h"
#include "memory_check.h"

namespace CLI {
class App;
}

namespace chorus::app {

struct BenchConfig {
  std::string model = "wrn-16-4";
  std::string devices;  // default: cuda:0 if present, else cpu
  std::string strategy = "single";
  std::string precision = "fp32";
  bool channels_last = false;
  bool no_cuda_graphs = false;          // eager steps, not a replayed graph (CUDA devices)
  int64_t batch_size = 128;  // per device
  int64_t steps = 30;
  int64_t warmup = 8;
  double bucket_mb = 25;  // dp: gradient bucket size (0: one bucket)
  std::optional<double> last_bucket_mb;  // dp, ddp: the first layers' own bucket (unset: the library's default)
  bool dp_broadcast = false;  // dp: weights broadcast after each step instead of replicated updates
  bool dp_gather_output = false;  // dp: outputs gathered and the loss computed on the first device
  std::optional<std::string> dp_all_reduce;  // dp: auto | nccl | copy-engine | in-update (unset: CHORUS_DP_ALLREDUCE, else auto)
  std::optional<std::string> counts;  // device counts to run, e.g. "1,2,4" (unset: 1, 2, 4, ... up to the list)
  bool json = false;
  std::optional<std::string> trace;     // a Chrome/Perfetto trace of --trace-steps timed steps (last row)
  std::string trace_steps = "3-5";
  std::string comm_hook = "allreduce";  // ddp: allreduce | bf16
  bool broadcast_buffers = false;       // ddp: rank 0's buffers before every forward (PyTorch's default)
  bool ddp_worker = false;              // internal: one rank of a ddp row (apps/bench_ddp.h)
  // pipeline (apps/bench_pipeline.h)
  int64_t micro_batches = 8;
  std::string schedules = "naive,gpipe,1f1b";
  std::optional<std::string> balance;   // unset: by measured time
  std::string recompute = "never";
  int64_t virtual_stages = 0;
  // Also time plain steps (one device, no pipeline) of the micro-batch and of
  // the whole batch on the first device, and give each row the most its
  // schedule could reach over naive at that micro-batch's speed.
  bool bound = false;
  int64_t seq_len = 0;  // GPT models: tokens per sequence (0: 1024)
  std::string attention = "auto";  // GPT models: auto | fused | composite (ops::AttentionKernel)
  bool recompute_gelu = false;     // GPT models: --recompute-gelu (models::GPTConfig::recompute_gelu)
  // GPT models over a device mesh (apps/bench_gpt_mesh.cpp), one process per
  // rank under a launcher: --mesh dp=A,pp=B,tp=C [--sequence-parallel]
  // (pp > 1: a row per schedule of `schedules`, `micro_batches` each).
  std::optional<std::string> mesh;
  bool sequence_parallel = false;
  int tp_chunks = 1;  // --tp-chunks: sequence parallel collectives in chunks beside the products
  // GPT models, --strategy zero (data_parallel/sharded.h): the stage of a plain "zero" row
  std::optional<int> zero_stage;
  bool reshard_after_forward = true;
  bool zero_prefetch = true;  // --no-zero-prefetch: ShardOptions::prefetch off
  std::optional<std::string> zero_param_dtype;  // bf16 | fp32 (unset: bf16 under --precision bf16)
  MemoryPlanFlags memory;  // GPT models: the memory plan before the model is built (apps/memory_check.h)
};

void add_bench_options(CLI::App* cmd, BenchConfig& c);
// "ddp,zero-3" -> {"ddp", "zero-3"}; "" -> {}.
std::vector<std::string> split_list(const std::string& s);
int run_bench(const BenchConfig& c);
// A GPT model's row (apps/bench_gpt.cpp): tokens/s, MFU and peak memory.
int run_bench_gpt(const BenchConfig& c);
int run_bench_gpt_mesh(const BenchConfig& c);
// Where a row's numbers come from, added to every --json row: "device_name"
// (the first device's: the GPU's name, or the processor's model) and "commit"
// (git_commit()).
void add_provenance(nlohmann::ordered_json& row, const Device& device);
// A --strategy entry's ZeRO stage: zero -> --zero-stage (default 1); zero-N
// -> N; anything else 0.
int zero_stage_of(const std::string& strategy, const BenchConfig& c);
// --strategy as a list, checked (known names; ddp and zero rows only in a
// list, never mixed with single, dp or pipeline; --zero-stage 1-3).
std::vector<std::string> bench_strategies(const BenchConfig& c);
// img/s of plain training steps (strategy single) of `batch` samples on
// `device`, with c's model, precision, layout, graphs, steps and warm-up.
double plain_step_rate(const BenchConfig& c, const Device& device, int64_t batch);

}  // namespace chorus::app
