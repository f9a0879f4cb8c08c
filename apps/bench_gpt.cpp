// `chorus bench --model gpt2|...|dN [--strategy single|dp|pipeline]`: a GPT's
// training throughput on random token ids -- tokens/s, MFU (llm.c's FLOP
// count, per device) and the peak memory of the fullest device -- with the
// step `chorus train` runs (gpt_forward_backward, global
// clipping, AdamW with its parameter groups), timed after a warm-up.
#include <chrono>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "bench.h"
#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/core/rng.h"
#include "chorus/models/gpt.h"
#include "chorus/models/gpt_pipeline.h"
#include "chorus/parallel/data_parallel.h"
#include "chorus/parallel/pipeline.h"
#include "chorus/ops/factory.h"
#include "chorus/optim/adamw.h"
#include "chorus/optim/clip_grad.h"
#include "chorus/parallel/graphed_step.h"
#include "commands.h"
#include "memory_check.h"
#include "train_gpt.h"
#include "train_pipeline.h"

namespace chorus::app {

int run_bench_gpt(const BenchConfig& c) {
  CHORUS_CHECK(c.strategy == "single" || c.strategy == "dp" || c.strategy == "pipeline", "chorus bench --model ",
               c.model, ": --strategy ", c.strategy,
               " is not offered for GPT models yet (single, dp, pipeline; chorus train --strategy ddp trains them over "
               "processes)");
  CHORUS_CHECK(c.precision == "fp32" || c.precision == "bf16", "unknown precision '", c.precision, "'");
  CHORUS_CHECK(c.batch_size > 0 && c.steps > 0 && c.warmup >= 0, "--batch-size and --steps must be positive");
  const int64_t seq = c.seq_len > 0 ? c.seq_len : 1024;
  std::vector<Device> devices;
  if (c.strategy == "single") {
    devices = {c.devices.empty() ? (cuda_is_available() ? cuda_device(0) : cpu_device(0)) : Device(c.devices)};
  } else {
    devices = parse_devices(c.devices.empty() ? "all" : c.devices);
  }
  const Device dev = devices[0];
  CHORUS_CHECK(c.precision == "fp32" || dev.is_cuda(), "--precision bf16 needs a CUDA device (got ", dev.str(), ")");
  models::GPTConfig cfg = models::GPTConfig::named(c.model, 50257, std::max<int64_t>(seq, 1024));
  CHORUS_CHECK(seq <= cfg.context, "--seq-len ", seq, " is above the context");
  cfg.attention = ops::parse_attention_kernel(c.attention);
  CHORUS_CHECK(c.recompute == "never" || c.recompute == "always",
               "--recompute for a GPT is always (every block recomputes its activations) or never, got '", c.recompute, "'");
  cfg.recompute = c.recompute == "always";
  // The memory plan before the model is built (apps/memory_check.h);
  // pipelines split the model unevenly: no plan for them.
  std::optional<dist::MemoryPlan> plan;
  if (c.strategy != "pipeline") {
    const auto replicas = static_cast<int64_t>(devices.size());
    plan = check_gpt_memory_plan(cfg, {c.model, c.strategy, c.precision, c.batch_size, seq, replicas, 1, c.bucket_mb},
                                 dev, c.memory);
  }
  manual_seed(0);
  auto model = std::make_shared<models::GPT>(cfg);
  model->to(dev);
  optim::AdamWOptions ao{6e-4, 0.9, 0.95, 1e-8, 0.1};
  std::vector<Tensor> params;
  for (auto& [name, p] : model->named_parameters()) {
    params.push_back(p);
    ao.param_weight_decay.push_back(p.dim() >= 2 && name.find(".wte.") == std::string::npos &&
                                            name.find(".wpe.") == std::string::npos
                                        ? 0.1
                                        : 0.0);
  }
  optim::AdamW opt(params, ao);
  const std::optional<DType> cast = c.precision == "bf16" ? std::optional<DType>(kBFloat16) : std::nullopt;
  // The strategy: one device, DataParallel over the devices (batch_size each),
  // or the blocks as pipeline stages over them (batch_size sequences in
  // --micro-batches groups).
  nn::ModulePtr net = model;
  std::optional<models::GPTPipelineLayers> tied;
  std::shared_ptr<parallel::Pipeline> pipe;
  int64_t batch = c.batch_size;
  if (c.strategy == "dp") {
    net = std::make_shared<parallel::DataParallel>(model, devices, dp_options(c.bucket_mb, c.last_bucket_mb));
    batch *= static_cast<int64_t>(devices.size());
  } else if (c.strategy == "pipeline") {
    tied.emplace(model);
    parallel::PipelineOptions po;
    po.micro_batches = c.micro_batches;
    CHORUS_CHECK(po.micro_batches >= 1 && po.micro_batches <= batch, "--micro-batches ", po.micro_batches,
                 " must be from 1 to the batch of ", batch, " sequences");
    const std::string sched = c.schedules.find(',') == std::string::npos ? c.schedules : "1f1b";
    po.schedule = parallel::parse_schedule(sched);
    po.virtual_stages = c.virtual_stages;
    pipe = std::make_shared<parallel::Pipeline>(tied->layers(), c.balance ? parse_balance(*c.balance)
                                                                          : std::vector<int64_t>{},
                                                devices, po);
    net = pipe;
  }
  std::vector<std::pair<Tensor, Tensor>> batch_in{
      {randint(0, cfg.vocab, {batch, seq}, {kInt64, dev}), randint(0, cfg.vocab, {batch, seq}, {kInt64, dev})}};
  // The step as chorus train runs it: one CUDA graph on a GPU unless --no-cuda-graphs.
  parallel::GraphedStepOptions go;
  go.enabled = dev.is_cuda() && !c.no_cuda_graphs;
  go.devices = devices;
  go.on_fallback = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
  parallel::GraphedStep graphed(
      [&](const std::vector<Tensor>& in) {
        Tensor l = pipe ? pipeline_forward_backward(*model, *pipe, *tied, {{in[0], in[1]}}, cast)
                        : gpt_forward_backward(*model, *net, nullptr, {{in[0], in[1]}}, cast);
        optim::clip_grad_norm_(params, 1.0);
        opt.step();
        opt.zero_grad();
        if (tied) tied->sync_tied_weights();
        return std::vector<Tensor>{l};
      },
      go);
  Tensor loss;
  auto step = [&] { loss = graphed({batch_in[0].first, batch_in[0].second})[0]; };
  for (int64_t i = 0; i < c.warmup; ++i) step();
  for (const Device& d : devices) {
    synchronize(d);
    backend(d).reset_peak_bytes(d);
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < c.steps; ++i) step();
  for (const Device& d : devices) synchronize(d);
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double tok_s = static_cast<double>(batch * seq * c.steps) / dt;
  const double peak_flops = dev.is_cuda() ? bf16_peak_flops(backend(dev).device_name(dev)) : 0.0;
  const double mfu =
      peak_flops > 0 ? tok_s * cfg.flops_per_token(seq) / (peak_flops * static_cast<double>(devices.size())) : 0.0;
  size_t peak = 0;  // the most any device held
  for (const Device& d : devices) peak = std::max(peak, backend(d).peak_bytes(d));
  if (plan) std::fprintf(stderr, "%s\n", dist::measured_line(*plan, static_cast<int64_t>(peak)).c_str());
  std::string dev_names;
  for (const Device& d : devices) dev_names += (dev_names.empty() ? "" : ",") + d.str();
  nlohmann::ordered_json row = {{"model", c.model},
                                {"strategy", c.strategy},
                                {"devices", dev_names},
                                {"device_name", backend(dev).device_name(dev)},
                                {"precision", c.precision},
                                {"batch_per_device", c.batch_size},
                                {"seq_len", seq},
                                {"attention", c.attention},
                                {"recompute", c.recompute},
                                {"params", cfg.num_parameters()},
                                {"tok_per_s", tok_s},
                                {"step_ms", 1000.0 * dt / static_cast<double>(c.steps)},
                                {"mfu", peak_flops > 0 ? nlohmann::ordered_json(mfu) : nlohmann::ordered_json(nullptr)},
                                {"peak_mem_bytes", peak},
                                {"loss", loss.item()},
                                {"cuda_graph", graphed.replays() >= c.steps}};
  if (c.json) {
    std::printf("%s\n", row.dump().c_str());
  } else {
    std::printf("%-10s %-8s %-7s %-5s batch %lld x %lld  %10.0f tok/s  %8.2f ms/step", c.model.c_str(),
                c.strategy.c_str(), dev_names.c_str(), c.precision.c_str(), (long long)batch, (long long)seq,
                tok_s, 1000.0 * dt / static_cast<double>(c.steps));
    if (peak_flops > 0) std::printf("  MFU %5.1f%%", 100 * mfu);
    std::printf("  peak %8.1f MiB\n", static_cast<double>(peak) / (1 << 20));
  }
  return 0;
}

}  // namespace chorus::app
