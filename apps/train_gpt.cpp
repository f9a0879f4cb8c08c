// The GPT training driver (train_gpt.h): set up (data windows, model, AdamW
// with parameter groups, DDP, ZeRO or pipeline stages), resume, and then the
// loop (apps/train_gpt_loop.h: steps, validation, checkpoints, metrics and
// the closing summary); with the helpers the drivers share (data specs, the
// schedule, the forward and backward of a step).
//
// Note [GPT schedule]: the learning rate of step i (0-based) over a run of N
// steps with W warm-up steps is lr * (i + 1) / W during the warm-up, then a
// cosine from lr to lr * min_lr_ratio over the remaining N - W steps --
// ../shared/bench/torch_gpt.py's lr_at, so the convergence runs compare like
// for like.
#include "train_gpt.h"
#include "train_pipeline.h"
#include "train_zero.h"
#include "sharded_checkpoints.h"
#include "train_gpt_loop.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "chorus/autograd/autocast.h"
#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/core/rng.h"
#include "chorus/data/tokens.h"
#include "chorus/data_parallel/ddp.h"
#include "chorus/io/checkpoint.h"
#include "chorus/io/dir_lock.h"
#include "chorus/io/safetensors.h"
#include "chorus/models/gpt.h"
#include "chorus/models/gpt_pipeline.h"
#include "chorus/parallel/pipeline.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/elementwise.h"
#include "chorus/ops/factory.h"
#include "chorus/optim/adamw.h"
#include "chorus/parallel/data_parallel.h"
#include "commands.h"
#include "memory_check.h"
#include "run_log.h"
#include "run_position.h"
#include "train_dist.h"

namespace chorus::app {

bool text_spec(const std::string& spec) { return spec.rfind("text:", 0) == 0; }

// text:FILE without a range: its first 90% to train on, the rest to validate.
std::string train_spec(const std::string& data) {
  if (!text_spec(data)) return data;
  const std::string rest = data.substr(5);
  const size_t colon = rest.rfind(':');
  if (colon != std::string::npos && rest.find('-', colon) != std::string::npos) return data;
  return data + ":0-0.9";
}
std::string val_spec(const std::string& data, const std::optional<std::string>& val) {
  if (val) return *val;
  if (!text_spec(data)) return "";
  const std::string t = train_spec(data);
  return t == data ? "" : data + ":0.9-1";
}

int64_t seq_len_of(const TrainConfig& tc, const GptOptions& g) {
  return g.seq_len ? g.seq_len : (text_spec(tc.data) ? 256 : 1024);
}

double lr_at(int64_t i, int64_t total, int64_t warmup, double lr, double min_ratio) {
  if (i < warmup) return lr * static_cast<double>(i + 1) / static_cast<double>(warmup);
  const double span = static_cast<double>(std::max<int64_t>(1, total - warmup));
  const double c = 0.5 * (1.0 + std::cos(M_PI * static_cast<double>(i - warmup) / span));
  return lr * (min_ratio + (1.0 - min_ratio) * c);
}

namespace {

std::vector<Device> gpt_devices(const TrainConfig& tc) {
  if (tc.strategy == "ddp" || tc.strategy == "zero") {
    std::vector<Device> devs = ddp_devices(tc.devices, ddp_launch_env(tc.strategy));
    CHORUS_CHECK(devs.size() == 1, "GPT models under --strategy ", tc.strategy,
                 " take one device per process, got --devices ", tc.devices);
    return devs;
  }
  if (tc.strategy == "dp" || tc.strategy == "pipeline") return parse_devices(tc.devices.empty() ? "all" : tc.devices);
  if (tc.devices.empty()) return {cuda_is_available() ? cuda_device(0) : cpu_device(0)};
  std::vector<Device> devs = parse_devices(tc.devices);
  CHORUS_CHECK(devs.size() == 1, "--strategy single trains on one device, got --devices ", tc.devices,
               " (use --strategy dp for several)");
  return devs;
}

}  // namespace

std::string fmt_count(double v) {
  char buf[32];
  if (v >= 1e6) std::snprintf(buf, sizeof buf, "%.2fM", v / 1e6);
  else if (v >= 1e3) std::snprintf(buf, sizeof buf, "%.1fk", v / 1e3);
  else std::snprintf(buf, sizeof buf, "%.0f", v);
  return buf;
}

nlohmann::json gpt_config_json(const TrainConfig& tc, const GptOptions& g, const GptTraining& r) {
  return {{"model", tc.model}, {"data", tc.data}, {"seq_len", r.seq}, {"batch_size", r.batch},
          {"grad_accum", r.accum}, {"lr", r.lr}, {"precision", tc.precision}, {"seed", tc.seed},
          {"vocab", r.model->config().vocab}, {"context", r.model->config().context}, {"dropout", g.dropout}};
}

bool is_gpt_model(const std::string& model) { return models::GPTConfig::is_gpt_name(model); }

Tensor gpt_forward_backward(models::GPT& model, nn::Module& net, dist::DistributedDataParallel* ddp,
                            const std::vector<std::pair<Tensor, Tensor>>& micro, std::optional<DType> autocast,
                            dist::ShardedDataParallel* sdp) {
  const int64_t n = static_cast<int64_t>(micro.size());
  Tensor total;
  for (int64_t m = 0; m < n; ++m) {
    std::optional<dist::DistributedDataParallel::NoSync> quiet;
    std::optional<dist::ShardedDataParallel::NoSync> quiet_shards;
    if (ddp && m + 1 < n) quiet.emplace(ddp->no_sync());
    if (sdp && m + 1 < n) quiet_shards.emplace(sdp->no_sync());
    Tensor loss;
    {
      AutocastGuard cast(autocast);
      // The logits are this step's alone: the classifier's gradient is written over them.
      loss = model.loss_of_logits(net.forward(micro[m].first), micro[m].second, std::nullopt, /*discard_logits=*/true);
    }
    (n > 1 ? loss.mul(1.0 / static_cast<double>(n)) : loss).backward();
    Tensor l = loss.detach();
    total = total.defined() ? ops::binary(BinaryOp::Add, total, l) : l;
  }
  return n > 1 ? ops::unary(UnaryOp::MulScalar, total, 1.0 / static_cast<double>(n)) : total;
}

// A pipelined step's forward and backward (Note [GPT as pipeline stages]):
// each micro-batch group through the stages, its loss weighted as
// gpt_forward_backward weighs it, and the tied embedding's two gradients
// merged into the one the optimizer sees.
Tensor pipeline_forward_backward(models::GPT& model, parallel::Pipeline& pipe, models::GPTPipelineLayers& tied,
                                 const std::vector<std::pair<Tensor, Tensor>>& micro, std::optional<DType> autocast) {
  const int64_t n = static_cast<int64_t>(micro.size());
  const double w = 1.0 / static_cast<double>(n);
  Tensor total;
  for (const auto& [ids, tg] : micro) {
    AutocastGuard cast(autocast);
    Tensor l = pipe.train_step(ids, tg, [&](const Tensor& out, const Tensor& t) {
                     return n > 1 ? model.loss_of_logits(out, t).mul(w) : model.loss_of_logits(out, t);
                   }).loss;
    total = total.defined() ? ops::binary(BinaryOp::Add, total, l) : l;
  }
  tied.merge_tied_gradients();
  return total;
}

double bf16_peak_flops(const std::string& name) {
  if (name.find("H100") != std::string::npos || name.find("H200") != std::string::npos) return 989.4e12;
  if (name.find("A100") != std::string::npos) return 312e12;
  return 0.0;
}

nlohmann::ordered_json run_train_gpt(const TrainConfig& tc, const GptOptions& g) {
  validate_gpt(tc, g);
  if (g.mesh) return run_train_gpt_mesh(tc, g);
  const auto t_start = std::chrono::steady_clock::now();
  GptTraining r;
  r.devices = gpt_devices(tc);
  const Device device = r.devices[0];
  CHORUS_CHECK(tc.precision == "fp32" || device.is_cuda(), "--precision bf16 needs a CUDA device (got ", device.str(),
               ")");
  if (tc.precision == "bf16") r.autocast = kBFloat16;
  r.seq = seq_len_of(tc, g);
  r.batch = g.batch_given ? tc.batch_size : 8;
  r.accum = g.grad_accum;
  r.lr = tc.lr.value_or(6e-4);

  // Data (Note [Token windows] in data/tokens.h).
  auto train_stream = data::TokenStream::open(train_spec(tc.data));
  const std::string vspec = val_spec(tc.data, g.val_data);
  const int64_t vocab = train_stream->natural_vocab() ? train_stream->natural_vocab() : 50257;
  const int64_t max_id = train_stream->max_token();
  CHORUS_CHECK(max_id < vocab, "token data ", train_stream->spec(), " holds token id ", max_id,
               ", past the model's vocabulary of ", vocab, " tokens");

  // The model: text trains with a context of its sequence length (torch_gpt.py's block), token files with GPT-2's 1024.
  const int64_t context = text_spec(tc.data) ? r.seq : 1024;
  CHORUS_CHECK(r.seq <= context, "--seq-len ", r.seq, " is above ", tc.model, "'s context of ", context, " positions");
  models::GPTConfig& cfg = r.cfg;
  cfg = models::GPTConfig::named(tc.model, vocab, context);
  cfg.dropout = g.dropout;
  cfg.attention = ops::parse_attention_kernel(g.attention);
  cfg.recompute_gelu = g.recompute_gelu;
  const std::string recompute = tc.recompute.value_or("never");
  cfg.recompute_blocks = recompute == "always" && tc.strategy != "pipeline" ? cfg.layers : 0;

  // The memory plan, before any rendezvous or allocation: a run that cannot
  // fit stops here, on every rank, with what would (apps/memory_check.h).
  // Pipelines split the model unevenly over their stages: no plan for them.
  if (tc.strategy != "pipeline") {
    const bool ranked = tc.strategy == "ddp" || tc.strategy == "zero";
    const int64_t world = ranked ? ddp_launch_env(tc.strategy).world_size : 1;
    GptRun run{tc.model, tc.strategy, tc.precision, r.batch, r.seq, r.replicas(), world, tc.bucket_mb,
               tc.strategy == "zero" ? tc.zero_stage.value_or(1) : 0, tc.zero_param_dtype.value_or(""), r.accum};
    MemoryPlanFlags flags = tc.memory;
    flags.quiet = tc.quiet || (ranked && ddp_launch_env(tc.strategy).rank != 0);
    cfg.recompute_blocks = gpt_recompute_blocks(recompute, cfg, run, device, flags);
    r.plan = check_gpt_memory_plan(cfg, run, device, flags);
  }

  if (tc.strategy == "ddp" || tc.strategy == "zero") r.ranks = join_job(ddp_launch_env(tc.strategy), device, tc.dist_timeout_s);
  const int rank = r.ranks ? r.ranks->env.rank : 0;
  const data::WindowOrder order = g.windows == "random" ? data::WindowOrder::Random : data::WindowOrder::Sequential;
  r.train = std::make_unique<data::TokenWindows>(train_stream, r.seq, rank, r.world(), tc.seed, order);
  if (!vspec.empty()) {
    auto vs = data::TokenStream::open(vspec);
    CHORUS_CHECK(vs->max_token() < vocab, "validation data ", vs->spec(), " holds token id ", vs->max_token(),
                 ", past the model's vocabulary of ", vocab, " tokens");
    r.val = std::make_unique<data::TokenWindows>(vs, r.seq, 0, 1, tc.seed, data::WindowOrder::Sequential);
  }
  manual_seed(tc.seed);
  r.model = std::make_shared<models::GPT>(cfg);
  if (g.init_from) {
    r.model->load_state_dict(models::gpt_from_hf(io::load_safetensors(*g.init_from), cfg));
  }
  r.model->to(device);

  r.net = r.model;
  if (tc.strategy == "dp" && r.replicas() > 1) {
    // Note [GPT under DataParallel]: the first device steps the weights and
    // broadcasts them (no replicated updates), so the global clipping of the
    // master gradients is the whole step's; the logits are gathered on the
    // first device, where the fused classifier takes the loss.
    r.net = std::make_shared<parallel::DataParallel>(r.model, r.devices, dp_options(tc.bucket_mb));
  }
  if (tc.strategy == "pipeline") {
    r.tied.emplace(r.model);
    parallel::PipelineOptions po;
    po.micro_batches = tc.micro_batches.value_or(4);
    CHORUS_CHECK(po.micro_batches <= r.batch, "--micro-batches ", po.micro_batches, " is more than the batch of ",
                 r.batch, " sequences");
    po.schedule = parallel::parse_schedule(tc.schedule.value_or("1f1b"));
    po.virtual_stages = tc.virtual_stages.value_or(0);
    // Under a pipeline the stages recompute, per micro-batch
    // (PipelineOptions::checkpoint), not the trunk's blocks.
    po.checkpoint = parallel::parse_checkpoint(recompute);
    r.pipe = std::make_shared<parallel::Pipeline>(r.tied->layers(), tc.balance ? parse_balance(*tc.balance)
                                                                                : std::vector<int64_t>{},
                                                  r.devices, po);
    r.net = r.pipe;
    if (!tc.quiet) {
      std::string bal, devs;
      for (int64_t b : r.pipe->balance()) bal += (bal.empty() ? "" : ",") + std::to_string(b);
      for (const Device& d : r.devices) devs += (devs.empty() ? "" : ",") + d.str();
      std::fprintf(stderr, "pipeline: %lld layers (embeddings, %lld blocks, head) in %lld stages (%s) over %s, "
                   "%lld micro-batches, schedule %s, recompute %s\n", (long long)r.tied->layers()->size(),
                   (long long)cfg.layers, (long long)r.pipe->num_stages(), bal.c_str(), devs.c_str(),
                   (long long)po.micro_batches, tc.schedule.value_or("1f1b").c_str(),
                   parallel::checkpoint_name(po.checkpoint).c_str());
    }
  }
  if (r.ranks) {
    // Note [Options every rank shares] (train_dist.h): the settings every rank
    // must train with, and the data each reads, compared before any collective.
    nlohmann::json fp = gpt_config_json(tc, g, r);
    fp["weight_decay"] = g.weight_decay_given ? tc.weight_decay : 0.1;
    fp["strategy"] = tc.strategy;
    fp["zero_stage"] = tc.zero_stage.value_or(0);
    fp["reshard_after_forward"] = tc.reshard_after_forward;
    fp["zero_prefetch"] = tc.zero_prefetch;
    fp["hybrid"] = tc.hybrid;
    fp["clip"] = g.clip;
    fp["warmup_steps"] = g.warmup_steps ? *g.warmup_steps : -1;
    fp["min_lr_ratio"] = g.min_lr_ratio;
    fp["decay_embeddings"] = g.decay_embeddings;
    fp["train_data"] = {{"tokens", train_stream->size()}, {"max_id", max_id}};
    fp["windows"] = g.windows;
    fp["steps"] = tc.steps ? *tc.steps : -1;
    fp["log_every"] = tc.log_every;
    check_same_options(*r.ranks, fp);
    dist::DDPOptions o;
    o.bucket_bytes = static_cast<int64_t>(tc.bucket_mb * (1 << 20));
    o.comm_hook = dist::parse_comm_hook(tc.comm_hook);
    if (tc.strategy == "zero") {
      // The blocks named as stage 3's units, their matrices gathered in
      // bfloat16 under --precision bf16 (add_gpt_sharding).
      dist::ShardOptions so = zero_flag_options(tc);
      add_gpt_sharding(so, *r.model, tc.precision == "bf16", tc.zero_param_dtype.value_or(""));
      r.sdp = make_sharded(tc, r.model, *r.ranks, so);
      r.net = r.sdp;
      if (r.leader() && !tc.quiet) std::fprintf(stderr, "%s\n", describe_sharding(*r.sdp, r.world()).c_str());
    } else {
      r.ddp = std::make_shared<dist::DistributedDataParallel>(r.model, r.ranks->group, o);
      r.net = r.ddp;
    }
  }

  // AdamW with two groups: matrices decay, the rest (biases, norms, and the
  // embeddings unless --decay-embeddings) do not.
  const double wd = g.weight_decay_given ? tc.weight_decay : 0.1;
  optim::AdamWOptions ao{r.lr, 0.9, 0.95, 1e-8, wd};
  auto decay_of = [&](const std::string& name, size_t dims) {
    const bool embedding = name.find(".wte.") != std::string::npos || name.find(".wpe.") != std::string::npos;
    return dims >= 2 && (!embedding || g.decay_embeddings) ? wd : 0.0;
  };
  std::vector<Tensor>& params = r.params;
  if (tc.strategy == "zero") {
    // Note [Sharded data parallelism]: the optimizer updates this rank's
    // pieces of the parameters; each piece decays as its parameter does.
    params = r.sdp->shard_parameters();
    for (const auto& pc : r.sdp->pieces()) ao.param_weight_decay.push_back(decay_of(pc.name, pc.shape.size()));
  } else {
    for (auto& [name, p] : r.model->named_parameters()) {
      params.push_back(p);
      ao.param_weight_decay.push_back(decay_of(name, static_cast<size_t>(p.dim())));
    }
  }
  r.opt = std::make_unique<optim::AdamW>(params, ao);

  // Steps: --steps, else --epochs over this rank's windows.
  const int64_t per_epoch = std::max<int64_t>(1, r.train->windows_per_rank() / (r.batch * r.replicas() * r.accum));
  r.step_tokens = r.tokens_per_step();  // a fresh run's; a resumed run takes its checkpoint's

  // Note [Checkpoint directory lock]: one job per checkpoint directory.
  std::optional<io::CheckpointDirLock> dir_lock;
  if (r.leader() && tc.checkpoint_dir) dir_lock.emplace(*tc.checkpoint_dir);

  // Resume.
  int64_t& start = r.start;
  int64_t& start_tokens = r.start_tokens;
  if (tc.resume) {
    const nlohmann::json mine = gpt_config_json(tc, g, r);
    auto check = [&](const io::TrainingState& st, const std::string& path) {
      for (const char* k : {"model", "seq_len", "vocab", "context"}) {
        CHORUS_CHECK(st.config.contains(k) && st.config[k] == mine[k], "checkpoint ", path, " was written with ", k,
                     " = ", st.config.contains(k) ? st.config[k].dump() : "(none)", ", this run has ", mine[k].dump());
      }
    };
    // Note [Checkpoints at any layout] (apps/sharded_checkpoints.h).
    const io::Resumed res = resume_at_any_layout(*tc.checkpoint_dir, *r.model, *r.opt, r.sdp.get(), tc.start_fresh, check);
    if (res.path) {
      // Note [Progress in samples]: the position is the tokens consumed and the
      // steps are the run's first (reference) ones, so a run resumed with
      // another world size or batch continues the same curve to the same end.
      const SavedPosition at = read_position(res.state.extra, kTokenKeys, res.state.step, r.tokens_per_step(),
                                             state_file_of(*res.path));
      start_tokens = at.consumed;
      r.step_tokens = at.per_step;
      start = start_tokens / r.tokens_per_step();
      default_generator().set_state(res.state.rng);
      if (r.leader()) std::fprintf(stderr, "resumed from %s at step %lld\n", res.path->c_str(), (long long)start);
      if (r.tied) r.tied->sync_tied_weights();
    }
  }

  // The budget (--steps reference steps, else --epochs of this run's steps),
  // the schedule over reference steps, and this run's own last step.
  int64_t budget = 0;
  if (tc.steps)
    CHORUS_CHECK(!__builtin_mul_overflow(*tc.steps, r.step_tokens, &budget), "--steps ", *tc.steps, " of ",
                 r.step_tokens, " tokens each is more tokens than can be counted");
  r.total_steps = tc.steps ? start + steps_left(start_tokens, budget, r.tokens_per_step()) : per_epoch * tc.epochs;
  r.schedule_steps = tc.steps ? *tc.steps : per_epoch * tc.epochs * r.tokens_per_step() / r.step_tokens;
  r.warmup = g.warmup_steps ? std::max<int64_t>(*g.warmup_steps, 0) : std::max<int64_t>(1, r.schedule_steps / 20);

  const int64_t n_params = cfg.num_parameters();
  if (r.leader() && !tc.quiet) {
    std::fprintf(stderr, "%s: %.1fM parameters, %lld layers x %lld heads x %lld wide, vocabulary %lld (%lld rows), "
                 "seq %lld, batch %lld x %lld devices x %lld accum x %d ranks = %s tokens/step, %lld steps (warm-up %lld), %s on %s\n",
                 tc.model.c_str(), static_cast<double>(n_params) / 1e6, (long long)cfg.layers, (long long)cfg.heads,
                 (long long)cfg.width, (long long)cfg.vocab, (long long)cfg.padded_vocab, (long long)r.seq,
                 (long long)r.batch, (long long)r.replicas(), (long long)r.accum, r.world(), fmt_count(static_cast<double>(r.tokens_per_step())).c_str(),
                 (long long)r.total_steps, (long long)r.warmup, tc.precision.c_str(), device.str().c_str());
  }
  // --metrics, --tensorboard and --plot (apps/run_log.h): rank 0's, or every
  // rank's TensorBoard files with --tensorboard-all-ranks.
  RunLogOptions lo;
  if (r.leader()) {
    lo.metrics = tc.metrics;
    lo.plot = tc.plot;
  }
  lo.append = tc.resume && start > 0;
  lo.tensorboard = tensorboard_run_dir(r.leader() || tc.tensorboard_all_ranks ? tc.tensorboard : std::nullopt,
                                       tc.model, tc.strategy, r.ranks ? &*r.ranks : nullptr, tc.tensorboard_all_ranks);
  lo.run_name = tc.metrics ? std::filesystem::path(*tc.metrics).stem().string() : tc.model + " " + tc.strategy;
  RunLog log(lo);
  if (log.tensorboard() && !tc.quiet) std::fprintf(stderr, "tensorboard: %s\n", log.tensorboard()->path().c_str());

  return run_gpt_loop(tc, g, r, log, t_start);
}

}  // namespace chorus::app
