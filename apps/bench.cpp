// Throughput of whole training steps (forward, backward, SGD+Nesterov update)
// on synthetic CIFAR-shaped data, timed after warm-up with the device drained
// before and after, as ../shared/bench/torch_baseline.py times PyTorch.
#include "bench.h"
#include "train_gpt.h"
#include "train_step.h"
#include "chorus/core/env_switches.h"
#include "chorus/ops/comm.h"
#include "bench_ddp.h"
#include "bench_pipeline.h"
#include "step_trace.h"
#include "cli_numbers.h"
#include "cli_options.h"
#include "commands.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include <nlohmann/json.hpp>

#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/core/rng.h"
#include "chorus/models/models.h"
#include "chorus/ops/profile.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/factory.h"
#include "chorus/optim/sgd.h"

namespace chorus::app {

void add_bench_options(CLI::App* cmd, BenchConfig& c) {
  cmd->add_option("--model", c.model, "mlp|cnn|resnet20|wrn-16-4|wrn-28-10 | gpt2 ... gpt2-xl, d2 ... d84")->capture_default_str();
  cmd->add_option("--devices", c.devices, "Device list (default: cuda:0 if present, else cpu)")->check(non_empty_devices, "DEVICES");
  cmd->add_option("--strategy", c.strategy, "single|dp|pipeline, or a list of ddp, zero, zero-1, zero-2, zero-3 (a row each; image models: one process per device, launched by the bench; GPT models: under a launcher)")->capture_default_str();
  cmd->add_option("--zero-stage", c.zero_stage, "GPT models, --strategy zero: 1, 2 or 3 (default 1)");
  cmd->add_flag("--reshard-after-forward,!--no-reshard-after-forward", c.reshard_after_forward, "zero stage 3: free each block's gathered weights after its forward (default on)");
  cmd->add_flag("--zero-prefetch,!--no-zero-prefetch", c.zero_prefetch, "zero: issue the weights' gathers ahead of use (stage 3: the next block's; stages 1-2: every bucket's as the forward starts) (default on)");
  app::add_optional(cmd, "--zero-param-dtype", c.zero_param_dtype, "zero: the dtype the blocks' matrices are gathered in, bf16 or fp32 (default: bf16 under --precision bf16)");
  cmd->add_option("--comm-hook", c.comm_hook,
                  "ddp: allreduce | bf16 | noop (no communication: the step's speed without it, for headroom analysis)")->capture_default_str();
  cmd->add_flag("--broadcast-buffers", c.broadcast_buffers,
                "ddp: broadcast rank 0's buffers before every forward (PyTorch's default; chorus train does it before evaluations)");
  cmd->add_flag("--ddp-worker", c.ddp_worker, "(internal) one rank of a --strategy ddp row")->group("");
  cmd->add_option("--bucket-mb", c.bucket_mb, "dp, ddp: gradient bucket size in MiB (0: one sum at the end)")->capture_default_str();
  add_optional(cmd, "--last-bucket-mb", c.last_bucket_mb,
               "dp, ddp: the first layers' gradients in a bucket of their own of at most this many MiB, a short tail "
               "after the backward (0: none; default: ddp 1, dp 0)");
  cmd->add_flag("--dp-gather-output", c.dp_gather_output,
                "dp: gather the outputs on the first device and compute the loss there (PyTorch's DataParallel) instead "
                "of each replica computing its chunk's loss");
  add_optional(cmd, "--dp-all-reduce", c.dp_all_reduce,
               "dp: how the replicas' gradients are summed: auto, nccl, copy-engine or in-update (two GPUs' copy "
               "engines exchange the gradients, the optimizer's update adds them; auto: in-update on two GPUs with "
               "peer access, else nccl; default: CHORUS_DP_ALLREDUCE, else auto)");
  cmd->add_flag("--dp-broadcast", c.dp_broadcast,
                "dp: the first device steps the weights and broadcasts them to the replicas after each step (PyTorch's "
                "DataParallel) instead of every replica stepping its own copy with all-reduced gradients");
  add_optional(cmd, "--device-counts", c.counts, "Device counts to run, e.g. 1,2,4 (dp, ddp; default powers of two)");
  cmd->add_option("--precision", c.precision, "fp32|bf16")->capture_default_str();
  cmd->add_flag("--channels-last", c.channels_last, "NHWC activations (GPU)");
  cmd->add_flag("--no-cuda-graphs", c.no_cuda_graphs,
                "time eager steps (default on CUDA devices for single, dp, ddp and pipeline: the step captured as a CUDA graph and replayed)");
  cmd->add_option("--batch-size", c.batch_size, "Batch per device")->capture_default_str();
  cmd->add_option("--steps", c.steps, "Timed steps")->capture_default_str();
  cmd->add_option("--warmup", c.warmup, "Untimed warm-up steps")->capture_default_str();
  cmd->add_option("--micro-batches", c.micro_batches, "pipeline: micro-batches per batch")->capture_default_str()->transform(integer_up_to(kMaxBatchSize));
  cmd->add_option("--schedules", c.schedules, "pipeline: rows to run, from naive, gpipe, 1f1b, interleaved")->capture_default_str();
  add_optional(cmd, "--balance", c.balance, "pipeline: layers per stage, e.g. 14,15, or time | memory: split by measured time (default) or memory");
  cmd->add_option("--recompute", c.recompute, "pipeline: never | except_last | always; GPT models: never | always (every block) | N (the first N blocks) | auto (the fewest the memory plan needs)")->capture_default_str();
  cmd->add_option("--virtual-stages", c.virtual_stages, "pipeline, interleaved: stages per device (0: 2)")->capture_default_str()->transform(integer_up_to(64));
  cmd->add_flag("--bound", c.bound,
                "pipeline: also time plain steps of the micro-batch and the whole batch on the first device, and give "
                "each row's best possible speed-up over naive (two GPUs each busy 1 - ideal bubble of the time at the "
                "micro-batch's speed)");
  cmd->add_flag("--json", c.json, "One JSON object per row");
  add_optional(cmd, "--mesh", c.mesh,
               "GPT models: dp=A,pp=B,tp=C (tensor parallel, pipeline stages with --micro-batches and --schedules; "
               "A x B x C processes started by chorus launch, rows from rank 0)");
  cmd->add_flag("--sequence-parallel", c.sequence_parallel, "GPT models with --mesh tp>1: sequence parallelism");
  cmd->add_option("--tp-chunks", c.tp_chunks,
                  "GPT models with --mesh tp>1 --sequence-parallel: split each rank's tokens into K chunks so that the "
                  "all-gathers and reduce-scatters run beside the matrix products (1: one collective per op; a K that "
                  "does not divide the tokens per rank runs as 1)")
      ->capture_default_str();
  cmd->add_option("--seq-len", c.seq_len, "GPT models (gpt2 ... d84): tokens per sequence (default 1024)")
      ->transform(integer_up_to(1 << 20));
  cmd->add_flag("--recompute-gelu", c.recompute_gelu,
                "GPT models: the MLP keeps GELU's input only and the backward computes GELU again");
  cmd->add_option("--attention", c.attention,
                  "GPT models: auto (the fused flash kernel where the GPU has one) | fused | composite")
      ->capture_default_str();
  add_optional(cmd, "--trace", c.trace,
               "Write a Chrome/Perfetto trace (JSON) of --trace-steps timed steps of the last row (single, dp; GPT "
               "models with --mesh: every rank in one file)");
  cmd->add_option("--trace-steps", c.trace_steps, "The timed steps --trace records, e.g. 5-7 (from 1)")->capture_default_str();
}

namespace {

std::vector<int64_t> parse_counts(const std::optional<std::string>& given, int64_t max_devices) {
  std::vector<int64_t> out;
  if (!given) {
    for (int64_t n = 1; n <= max_devices; n *= 2) out.push_back(n);
    if (out.back() != max_devices) out.push_back(max_devices);
    return out;
  }
  const std::string& text = *given;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    std::string item = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    int64_t n = 0;
    size_t used = 0;
    try {
      n = std::stoll(item, &used);
    } catch (...) {
    }
    CHORUS_CHECK(used > 0 && used == item.size(), "--device-counts: '", item, "' is not a number");
    CHORUS_CHECK(n >= 1 && n <= max_devices, "--device-counts: ", n, " is outside 1..", max_devices,
                 " (the number of devices in --devices)");
    out.push_back(n);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

struct BenchRow {
  double img_per_s, step_ms, loss;
  size_t peak;
  double host_issue_ms;  // host time to issue all timed steps, before the final synchronize
  // Host time per timed step in each phase (where an issue-bound step spends
  // its time): forward + loss, zero_grad + backward, optimizer step.
  double forward_ms, backward_ms, optim_ms;
  bool graphed;  // every timed step replayed a CUDA graph
};

BenchRow bench_one(const BenchConfig& c, const std::vector<Device>& devs, StepTracer* tracer = nullptr) {
  Device dev = devs[0];
  manual_seed(0);
  bool small = c.model == "mlp" || c.model == "cnn";
  models::ModelSpec spec{small ? Shape{1, 28, 28} : Shape{3, 32, 32}, 10};
  nn::ModulePtr model = models::make_model(c.model, spec);
  model->to(dev);
  if (c.channels_last && dev.is_cuda()) model->to_channels_last();
  optim::SGD opt(model->parameters(), {0.1, 0.9, 0.0, 5e-4, true});
  const int64_t batch = c.batch_size * static_cast<int64_t>(devs.size());
  Shape in{batch};
  in.insert(in.end(), spec.input.begin(), spec.input.end());
  Tensor x = randn(in, {kFloat32, dev});
  if (c.channels_last && dev.is_cuda()) x = ops::to_channels_last(x);
  Tensor y = randint(0, 10, {batch}, {kInt64, dev});
  TrainStep train_step{
      wrap_for_strategy(model, c.strategy, devs, c.bucket_mb, c.last_bucket_mb, c.dp_broadcast ? nullptr : &opt,
                        c.dp_all_reduce),
      &opt,
      std::nullopt, 0.0};
  if (c.precision == "bf16") train_step.autocast = kBFloat16;
  train_step.dp_gather_output = c.dp_gather_output;
  // CUDA graphs where they apply (captured during the warm-up's last steps).
  parallel::GraphedStepOptions graph_options;
  graph_options.devices = devs;
  bool graphed = !c.no_cuda_graphs && cuda_graphs_apply(c.strategy, devs) && train_step.enable_cuda_graphs(graph_options);
  TrainStep::Phases phases;
  Tensor loss;
  auto step = [&] { loss = train_step.run(x, y, &phases).loss; };
  for (int64_t i = 0; i < c.warmup; ++i) step();
  for (const Device& d : devs) synchronize(d);
  ops::reset_profile();
  for (const Device& d : devs) backend(d).reset_peak_bytes(d);
  phases = {};
  // CHORUS_PROFILER_RANGE=1: an external profiler records the timed steps only.
  const char* range_env = chorus::env::get("CHORUS_PROFILER_RANGE");
  const bool range = range_env && std::strcmp(range_env, "1") == 0 && dev.is_cuda();
  if (range) backend(dev).profiler_range(true);
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 1; i <= c.steps; ++i) {
    if (tracer) tracer->begin_step(i);
    step();
    if (tracer) tracer->end_step(i);
  }
  // Evidence of asynchrony: the host has issued every step long before the
  // GPU has finished them (nothing in a step waits for the device).
  double issue = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (const Device& d : devs) synchronize(d);
  if (range) backend(dev).profiler_range(false);
  if (tracer) tracer->finish();
  double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  size_t peak = 0;
  for (const Device& d : devs) peak = std::max(peak, backend(d).peak_bytes(d));
  const double n = static_cast<double>(c.steps);
  graphed = graphed && train_step.graph->replays() >= c.steps;
  return {static_cast<double>(batch * c.steps) / dt, 1000.0 * dt / n, loss.item(), peak, 1000.0 * issue,
          phases.forward_ms / n, phases.backward_ms / n, phases.optim_ms / n, graphed};
}

}  // namespace

namespace {
// The processor's model ("AMD EPYC 9654 96-Core Processor"), from /proc/cpuinfo where there is one.
std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos) {
      std::string m = line.substr(line.find(':') + 1);
      return m.substr(std::min(m.find_first_not_of(' '), m.size()));
    }
  return "";
}
}  // namespace

void add_provenance(nlohmann::ordered_json& row, const Device& device) {
  const std::string model = device.is_cuda() ? "" : cpu_model();
  row["device_name"] = model.empty() ? backend(device).device_name(device) : model + " (" + device.str() + ")";
  row["commit"] = git_commit();
}

double plain_step_rate(const BenchConfig& c, const Device& device, int64_t batch) {
  BenchConfig one = c;
  one.strategy = "single";
  one.batch_size = batch;
  return bench_one(one, {device}).img_per_s;
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  if (s.empty()) return out;
  size_t at = 0;
  while (at <= s.size()) {
    const size_t comma = s.find(',', at);
    out.push_back(s.substr(at, comma == std::string::npos ? std::string::npos : comma - at));
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return out;
}

int zero_stage_of(const std::string& strategy, const BenchConfig& c) {
  if (strategy == "zero") return c.zero_stage.value_or(1);
  if (strategy.rfind("zero-", 0) == 0 && strategy.size() == 6 && strategy[5] >= '1' && strategy[5] <= '3')
    return strategy[5] - '0';
  return 0;
}

std::vector<std::string> bench_strategies(const BenchConfig& c) {
  CHORUS_CHECK(!c.zero_stage || (*c.zero_stage >= 1 && *c.zero_stage <= 3), "--zero-stage must be 1, 2 or 3, got ",
               c.zero_stage.value_or(0));
  const std::vector<std::string> strategies = split_list(c.strategy);
  CHORUS_CHECK(!strategies.empty(), "--strategy is empty");
  bool ranked = false, alone = false;
  for (const std::string& s : strategies) {
    const bool r = s == "ddp" || zero_stage_of(s, c) > 0;
    CHORUS_CHECK(r || s == "single" || s == "dp" || s == "pipeline", "chorus bench --model ", c.model,
                 ": unknown --strategy '", s, "' (single, dp, pipeline; or a list of ddp, zero, zero-1, zero-2, zero-3)");
    (r ? ranked : alone) = true;
  }
  CHORUS_CHECK(!(ranked && alone), "--strategy ", c.strategy, " mixes strategies of one process with ddp/zero "
               "(one process per device): bench them in separate runs");
  CHORUS_CHECK(ranked || strategies.size() == 1, "--strategy takes a list only of ddp and zero rows, got ", c.strategy);
  return strategies;
}

int run_bench(const BenchConfig& c) {
  CHORUS_CHECK(!c.mesh || is_gpt_model(c.model), "--mesh is offered for GPT models (gpt2 ... d84) only, not ", c.model);
  CHORUS_CHECK(c.mesh || !c.sequence_parallel, "--sequence-parallel needs --mesh with tp > 1");
  CHORUS_CHECK(c.mesh || c.tp_chunks == 1, "--tp-chunks needs --mesh with tp > 1 and --sequence-parallel");
  CHORUS_CHECK(!c.trace || !is_gpt_model(c.model) || c.mesh, "chorus bench --trace of a GPT model goes with --mesh "
               "(under chorus launch), or trace its training: chorus train --model ", c.model, " --trace");
  if (is_gpt_model(c.model)) return c.mesh ? run_bench_gpt_mesh(c) : run_bench_gpt(c);
  if (c.ddp_worker) return run_bench_ddp_worker(c);
  CHORUS_CHECK(!c.trace || c.strategy == "single" || c.strategy == "dp",
               "chorus bench --trace goes with --strategy single or dp (a distributed job: chorus train --strategy ddp --trace)");
  if (c.trace) (void)parse_trace_steps(c.trace_steps);
  // The image models' ddp and zero rows are processes the bench starts
  // itself (one per device), a row for each strategy of the list at each
  // device count.
  const std::vector<std::string> strategies = bench_strategies(c);
  const bool ranked = strategies.front() == "ddp" || zero_stage_of(strategies.front(), c) > 0;
  for (const std::string& s : strategies)
    CHORUS_CHECK(!c.channels_last || zero_stage_of(s, c) == 0, "--channels-last is not offered with zero rows (a shard "
                 "is a range of a parameter's row-major elements): bench the zero rows NCHW");
  CHORUS_CHECK(c.zero_param_dtype == std::nullopt, "--zero-param-dtype is offered for GPT models; ", c.model,
               " is gathered in its parameters' own dtype");
  if (c.strategy == "pipeline") return run_bench_pipeline(c);
  CHORUS_CHECK(c.comm_hook == "allreduce" || c.comm_hook == "bf16" || c.comm_hook == "noop",
               "--comm-hook must be allreduce, bf16 or noop, got '", c.comm_hook, "'");
  CHORUS_CHECK(c.precision == "fp32" || c.precision == "bf16", "unknown precision '", c.precision, "'");
  CHORUS_CHECK(c.batch_size > 0, "--batch-size must be positive, got ", c.batch_size);
  CHORUS_CHECK(std::isfinite(c.bucket_mb) && c.bucket_mb >= 0, "--bucket-mb must be a number >= 0, got ", c.bucket_mb);
  CHORUS_CHECK(!c.last_bucket_mb || (std::isfinite(*c.last_bucket_mb) && *c.last_bucket_mb >= 0),
               "--last-bucket-mb must be a number >= 0, got ", c.last_bucket_mb.value_or(0));
  CHORUS_CHECK(c.steps > 0 && c.warmup >= 0, "--steps must be positive and --warmup >= 0");
  CHORUS_CHECK(!c.dp_broadcast || c.strategy == "dp", "--dp-broadcast goes with --strategy dp");
  CHORUS_CHECK(!c.dp_gather_output || c.strategy == "dp", "--dp-gather-output goes with --strategy dp");
  check_dp_all_reduce(c.dp_all_reduce, c.strategy, c.dp_broadcast);
  const parallel::DataParallelOptions dp_opts =
      c.strategy == "dp" ? dp_options(c.bucket_mb, c.last_bucket_mb, c.dp_all_reduce) : parallel::DataParallelOptions{};
  std::vector<Device> all = c.devices.empty()
                                ? std::vector<Device>{cuda_is_available() ? cuda_device(0) : cpu_device(0)}
                                : parse_devices(c.devices);
  CHORUS_CHECK(c.precision == "fp32" || all[0].is_cuda(), "--precision bf16 needs a CUDA device");
  std::vector<int64_t> counts = c.strategy == "single" ? std::vector<int64_t>{1}
                                                       : parse_counts(c.counts, static_cast<int64_t>(all.size()));
  double base = 0;
  for (int64_t n : counts)
  for (const std::string& strategy : strategies) {
    std::vector<Device> devs(all.begin(), all.begin() + n);
    BenchRow r{};
    const CommCounts comm_before = comm_counts();
    const int stage = zero_stage_of(strategy, c);
    const std::string label = stage > 0 ? "zero-" + std::to_string(stage) : strategy;
    if (ranked) {
      const nlohmann::ordered_json got = bench_ddp_row(c, label, all, n);
      r.img_per_s = got["img_per_s"].get<double>();
      r.step_ms = got["step_ms"].get<double>();
      r.peak = got["peak_mem_bytes"].get<size_t>();
      r.loss = got["loss"].get<double>();
      r.host_issue_ms = got.value("host_issue_ms", 0.0);
      r.graphed = got.value("cuda_graphs", false);
    } else {
      // --trace: the last row's timed steps.
      StepTracer tracer(n == counts.back() ? c.trace : std::nullopt, c.trace_steps);
      r = bench_one(c, devs, &tracer);
    }
    if (n == 1 && strategy == strategies.front()) base = r.img_per_s;
    double eff = base > 0 ? r.img_per_s / (static_cast<double>(n) * base) : 0;
    nlohmann::ordered_json row = {{"model", c.model},
                                  {"strategy", label},
                                  {"devices", n},
                                  {"device_list", devs.size() == 1 ? devs[0].str() : c.devices},
                                  {"precision", c.precision},
                                  {"channels_last", c.channels_last},
                                  {"cuda_graphs", r.graphed},
                                  {"batch_per_device", c.batch_size},
                                  {"bucket_mb", c.strategy != "single" ? nlohmann::ordered_json(c.bucket_mb) : nullptr},
                                  {"last_bucket_mb", c.strategy != "single" && c.last_bucket_mb
                                                         ? nlohmann::ordered_json(*c.last_bucket_mb)
                                                         : nullptr},
                                  {"dp_updates", c.strategy == "dp" ? nlohmann::ordered_json(c.dp_broadcast ? "broadcast" : "replicated")
                                                                    : nullptr},
                                  {"dp_loss", c.strategy == "dp" ? nlohmann::ordered_json(c.dp_gather_output ? "gathered" : "per_replica")
                                                                 : nullptr},
                                  {"dp_all_reduce", c.strategy == "dp" && !c.dp_broadcast && n > 1
                                                        ? nlohmann::ordered_json(dp_all_reduce_name(comm_before, devs[0], dp_opts))
                                                        : nullptr},
                                  {"dp_grads", c.strategy == "dp" && !c.dp_broadcast && n > 1
                                                   ? nlohmann::ordered_json(dp_grads_name(comm_before, devs[0], dp_opts))
                                                   : nullptr},
                                  {"comm_hook", ranked ? nlohmann::ordered_json(c.comm_hook) : nullptr},
                                  {"broadcast_buffers", strategy == "ddp" ? nlohmann::ordered_json(c.broadcast_buffers) : nullptr},
                                  {"zero_stage", stage > 0 ? nlohmann::ordered_json(stage) : nullptr},
                                  {"img_per_s", r.img_per_s},
                                  {"step_ms", r.step_ms},
                                  {"peak_mem_bytes", r.peak},
                                  {"host_issue_ms", r.host_issue_ms},
                                  {"total_ms", r.step_ms * static_cast<double>(c.steps)},
                                  {"host_forward_ms", r.forward_ms},
                                  {"host_backward_ms", r.backward_ms},
                                  {"host_optim_ms", r.optim_ms},
                                  {"scaling_efficiency", base > 0 ? nlohmann::ordered_json(eff) : nullptr},
                                  {"loss", r.loss}};
    add_provenance(row, devs[0]);
    if (c.json) {
      std::printf("%s\n", row.dump().c_str());
    } else {
      std::printf("%-10s %-7s %2lld dev  %-5s batch %-4lld/dev %10.1f img/s %8.2f ms/step  peak %8.1f MiB%s%s\n",
                  c.model.c_str(), label.c_str(), (long long)n, c.precision.c_str(), (long long)c.batch_size,
                  r.img_per_s, r.step_ms, static_cast<double>(r.peak) / (1 << 20),
                  base > 0 && n > 1 ? ("  efficiency " + std::to_string(eff).substr(0, 4)).c_str() : "",
                  r.graphed ? "  (CUDA graph)" : "");
    }
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace chorus::app
