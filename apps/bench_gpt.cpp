// `chorus bench --model gpt2|...|dN [--strategy single|dp|pipeline]`, or under
// a launcher `--strategy ddp,zero-1,zero-3` (rows side by side): a GPT's
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
#include "chorus/data_parallel/ddp.h"
#include "chorus/data_parallel/sharded.h"
#include "chorus/models/gpt.h"
#include "chorus/ops/copy.h"
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
#include "train_dist.h"
#include "train_pipeline.h"
#include "train_zero.h"

namespace chorus::app {

namespace {

// One row: the strategy's step as chorus train runs it, timed after a warm-up.
// `ranks`: the job, for ddp and zero (every rank runs it; rank 0 prints).
void bench_gpt_row(const BenchConfig& c, const std::string& strategy, const std::vector<Device>& devices,
                   const RankContext* ranks) {
  const int64_t seq = c.seq_len > 0 ? c.seq_len : 1024;
  const Device dev = devices[0];
  const int world = ranks ? ranks->env.world_size : 1;
  const bool leader = !ranks || ranks->leader();
  models::GPTConfig cfg = models::GPTConfig::named(c.model, 50257, std::max<int64_t>(seq, 1024));
  CHORUS_CHECK(seq <= cfg.context, "--seq-len ", seq, " is above the context");
  cfg.attention = ops::parse_attention_kernel(c.attention);
  cfg.recompute_gelu = c.recompute_gelu;
  cfg.recompute_blocks = c.recompute == "always" && strategy != "pipeline" ? cfg.layers : 0;
  const int stage = zero_stage_of(strategy, c);
  // The memory plan before the model is built (apps/memory_check.h);
  // pipelines split the model unevenly: no plan for them.
  std::optional<dist::MemoryPlan> plan;
  if (strategy != "pipeline") {
    const auto replicas = strategy == "dp" ? static_cast<int64_t>(devices.size()) : int64_t{1};
    MemoryPlanFlags flags = c.memory;
    flags.quiet = flags.quiet || !leader;
    const GptRun run{c.model, stage > 0 ? "zero" : strategy, c.precision, c.batch_size, seq, replicas,
                     world, c.bucket_mb, stage, c.zero_param_dtype.value_or("")};
    cfg.recompute_blocks = gpt_recompute_blocks(c.recompute, cfg, run, dev, flags);
    plan = check_gpt_memory_plan(cfg, run, dev, flags);
  }
  manual_seed(0);
  auto model = std::make_shared<models::GPT>(cfg);
  model->to(dev);
  // The strategy: one device, DataParallel over the devices (batch_size each),
  // the blocks as pipeline stages over them (batch_size sequences in
  // --micro-batches groups), or one rank per device (ddp, zero).
  nn::ModulePtr net = model;
  std::optional<models::GPTPipelineLayers> tied;
  std::shared_ptr<parallel::Pipeline> pipe;
  std::shared_ptr<dist::DistributedDataParallel> ddp;
  std::shared_ptr<dist::ShardedDataParallel> sdp;
  int64_t batch = c.batch_size;
  if (strategy == "dp") {
    net = std::make_shared<parallel::DataParallel>(model, devices, dp_options(c.bucket_mb, c.last_bucket_mb));
    batch *= static_cast<int64_t>(devices.size());
  } else if (strategy == "pipeline") {
    tied.emplace(model);
    parallel::PipelineOptions po;
    po.micro_batches = c.micro_batches;
    CHORUS_CHECK(po.micro_batches >= 1 && po.micro_batches <= batch, "--micro-batches ", po.micro_batches,
                 " must be from 1 to the batch of ", batch, " sequences");
    const std::string sched = c.schedules.find(',') == std::string::npos ? c.schedules : "1f1b";
    po.schedule = parallel::parse_schedule(sched);
    po.virtual_stages = c.virtual_stages;
    po.checkpoint = parallel::parse_checkpoint(c.recompute);  // the stages recompute, per micro-batch
    pipe = std::make_shared<parallel::Pipeline>(tied->layers(), c.balance ? parse_balance(*c.balance)
                                                                          : std::vector<int64_t>{},
                                                devices, po);
    net = pipe;
  } else if (strategy == "ddp") {
    dist::DDPOptions o;
    o.bucket_bytes = static_cast<int64_t>(c.bucket_mb * (1 << 20));
    ddp = std::make_shared<dist::DistributedDataParallel>(model, ranks->group, o);
    net = ddp;
  } else if (stage > 0) {
    dist::ShardOptions so =
        zero_flag_options(stage, c.bucket_mb, c.reshard_after_forward, c.comm_hook, c.zero_prefetch);
    add_gpt_sharding(so, *model, c.precision == "bf16", c.zero_param_dtype.value_or(""));
    sdp = std::make_shared<dist::ShardedDataParallel>(model, ranks->group, so);
    net = sdp;
  }
  optim::AdamWOptions ao{6e-4, 0.9, 0.95, 1e-8, 0.1};
  auto decay = [](const std::string& name, size_t dims) {
    return dims >= 2 && name.find(".wte.") == std::string::npos && name.find(".wpe.") == std::string::npos ? 0.1 : 0.0;
  };
  std::vector<Tensor> params;
  if (sdp) {
    params = sdp->shard_parameters();
    for (const auto& pc : sdp->pieces()) ao.param_weight_decay.push_back(decay(pc.name, pc.shape.size()));
  } else {
    for (auto& [name, p] : model->named_parameters()) {
      params.push_back(p);
      ao.param_weight_decay.push_back(decay(name, static_cast<size_t>(p.dim())));
    }
  }
  optim::AdamW opt(params, ao);
  const std::optional<DType> cast = c.precision == "bf16" ? std::optional<DType>(kBFloat16) : std::nullopt;
  std::vector<std::pair<Tensor, Tensor>> batch_in{
      {randint(0, cfg.vocab, {batch, seq}, {kInt64, dev}), randint(0, cfg.vocab, {batch, seq}, {kInt64, dev})}};
  // The step as chorus train runs it: one CUDA graph on a GPU unless
  // --no-cuda-graphs (sharded steps stay eager, as in chorus train).
  parallel::GraphedStepOptions go;
  go.enabled = dev.is_cuda() && !c.no_cuda_graphs && !sdp;
  go.devices = devices;
  go.on_fallback = [leader](const std::string& line) {
    if (leader) std::fprintf(stderr, "%s\n", line.c_str());
  };
  parallel::GraphedStep graphed(
      [&](const std::vector<Tensor>& in) {
        Tensor l = pipe ? pipeline_forward_backward(*model, *pipe, *tied, {{in[0], in[1]}}, cast)
                        : gpt_forward_backward(*model, *net, ddp.get(), {{in[0], in[1]}}, cast, sdp.get());
        // As chorus train: the scale folded into AdamW (Note [Clipping in
        // the update] in optim/clip_grad.h), sharded or not.
        if (sdp) {
          opt.step_scaled(sdp->clip_grad_norm_scale(1.0).scale);
        } else {
          optim::clip_and_step(opt, params, 1.0);
        }
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
  if (ranks) ranks->group->barrier()->wait();
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < c.steps; ++i) step();
  for (const Device& d : devices) synchronize(d);
  if (ranks) ranks->group->barrier()->wait();
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double tok_s = static_cast<double>(batch * seq * c.steps * world) / dt;
  const double peak_flops = dev.is_cuda() ? bf16_peak_flops(backend(dev).device_name(dev)) : 0.0;
  const double mfu = peak_flops > 0 ? tok_s * cfg.flops_per_token(seq) /
                                          (peak_flops * static_cast<double>(devices.size()) * world)
                                    : 0.0;
  size_t peak = 0;  // the most any device held
  for (const Device& d : devices) peak = std::max(peak, backend(d).peak_bytes(d));
  if (ranks) {
    // The fullest rank's peak.
    Tensor t = ops::to_device(from_vector(std::vector<int64_t>{static_cast<int64_t>(peak)}, {1}), ranks->group->device());
    ranks->group->all_reduce(t, dist::ReduceOp::Max)->wait();
    peak = static_cast<size_t>(t.to_vector<int64_t>()[0]);
  }
  const double loss_value = loss.item();
  if (!leader) return;
  if (plan) std::fprintf(stderr, "%s\n", dist::measured_line(*plan, static_cast<int64_t>(peak)).c_str());
  std::string dev_names;
  for (const Device& d : devices) dev_names += (dev_names.empty() ? "" : ",") + d.str();
  if (ranks) dev_names = std::to_string(world) + " ranks (" + dev.str() + ", ...)";
  const std::string label = stage > 0 ? "zero-" + std::to_string(stage) : strategy;
  nlohmann::ordered_json row = {{"model", c.model},
                                {"strategy", label},
                                {"devices", dev_names},
                                {"device_name", backend(dev).device_name(dev)},
                                {"precision", c.precision},
                                {"batch_per_device", c.batch_size},
                                {"seq_len", seq},
                                {"attention", c.attention},
                                {"recompute", c.recompute},
                                {"recompute_gelu", c.recompute_gelu},
                                {"params", cfg.num_parameters()},
                                {"tok_per_s", tok_s},
                                {"step_ms", 1000.0 * dt / static_cast<double>(c.steps)},
                                {"mfu", peak_flops > 0 ? nlohmann::ordered_json(mfu) : nlohmann::ordered_json(nullptr)},
                                {"peak_mem_bytes", peak},
                                {"loss", loss_value},
                                {"cuda_graph", graphed.replays() >= c.steps}};
  add_provenance(row, dev);  // device_name and commit, as every bench row
  // Note [Device memory breakdown]: where the device's memory is, at the end.
  (void)add_device_memory(row, dev);
  if (c.json) {
    std::printf("%s\n", row.dump().c_str());
  } else {
    std::printf("%-10s %-8s %-7s %-5s batch %lld x %lld  %10.0f tok/s  %8.2f ms/step", c.model.c_str(),
                label.c_str(), dev_names.c_str(), c.precision.c_str(), (long long)(batch * world), (long long)seq,
                tok_s, 1000.0 * dt / static_cast<double>(c.steps));
    if (peak_flops > 0) std::printf("  MFU %5.1f%%", 100 * mfu);
    std::printf("  peak %8.1f MiB\n", static_cast<double>(peak) / (1 << 20));
  }
  std::fflush(stdout);
}

}  // namespace

int run_bench_gpt(const BenchConfig& c) {
  CHORUS_CHECK(c.precision == "fp32" || c.precision == "bf16", "unknown precision '", c.precision, "'");
  CHORUS_CHECK(c.batch_size > 0 && c.steps > 0 && c.warmup >= 0, "--batch-size and --steps must be positive");
  check_gpt_recompute_spelling(c.recompute);
  CHORUS_CHECK(c.strategy.find("pipeline") == std::string::npos || c.recompute == "never" || c.recompute == "always",
               "--recompute ", c.recompute, " counts blocks outside pipelines; --strategy pipeline recomputes per "
               "micro-batch: never or always");
  const std::vector<std::string> strategies = bench_strategies(c);
  const bool over_ranks = strategies.front() == "ddp" || zero_stage_of(strategies.front(), c) > 0;
  if (!over_ranks) {
    std::vector<Device> devices;
    if (c.strategy == "single")
      devices = {c.devices.empty() ? (cuda_is_available() ? cuda_device(0) : cpu_device(0)) : Device(c.devices)};
    else
      devices = parse_devices(c.devices.empty() ? "all" : c.devices);
    CHORUS_CHECK(c.precision == "fp32" || devices[0].is_cuda(), "--precision bf16 needs a CUDA device (got ",
                 devices[0].str(), ")");
    bench_gpt_row(c, c.strategy, devices, nullptr);
    return 0;
  }
  // ddp and zero rows: one process per device, under chorus launch, torchrun, mpirun or srun.
  const dist::LaunchEnv env = ddp_launch_env(c.strategy, "bench --model " + c.model);
  std::vector<Device> devices = ddp_devices(c.devices, env);
  CHORUS_CHECK(devices.size() == 1, "GPT rows over ranks take one device per process, got --devices ", c.devices);
  CHORUS_CHECK(c.precision == "fp32" || devices[0].is_cuda(), "--precision bf16 needs a CUDA device (got ",
               devices[0].str(), ")");
  RankContext ranks = join_job(env, devices[0], 300);
  for (const std::string& s : strategies) bench_gpt_row(c, s, devices, &ranks);
  return 0;
}

}  // namespace chorus::app
