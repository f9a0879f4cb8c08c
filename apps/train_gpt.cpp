// The GPT training driver (train_gpt.h): set up (data windows, model, AdamW
// with parameter groups, DDP), resume, the loop (gradient accumulation,
// clipping, a cosine schedule with linear warm-up, periodic reads of the loss,
// validation, checkpoints, metrics) and the closing summary.
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

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>

#include "chorus/autograd/autocast.h"
#include "chorus/autograd/grad_mode.h"
#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/core/rng.h"
#include "chorus/data/tokens.h"
#include "chorus/dist/ddp.h"
#include "chorus/io/checkpoint.h"
#include "chorus/io/dir_lock.h"
#include "chorus/io/safetensors.h"
#include "chorus/models/gpt.h"
#include "chorus/models/gpt_pipeline.h"
#include "chorus/parallel/pipeline.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/elementwise.h"
#include "chorus/ops/factory.h"
#include "chorus/ops/profile.h"
#include "chorus/optim/adamw.h"
#include "chorus/optim/clip_grad.h"
#include "chorus/parallel/data_parallel.h"
#include "chorus/parallel/graphed_step.h"
#include "commands.h"
#include "memory_check.h"
#include "progress.h"
#include "run_log.h"
#include "run_position.h"
#include "step_trace.h"
#include "stop_signal.h"
#include "train_dist.h"

namespace chorus::app {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

}  // namespace

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

namespace {
std::vector<std::pair<Tensor, Tensor>> pairs_of(const std::vector<Tensor>& in) {
  std::vector<std::pair<Tensor, Tensor>> out;
  for (size_t i = 0; i + 1 < in.size(); i += 2) out.emplace_back(in[i], in[i + 1]);
  return out;
}
}  // namespace

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

namespace {

struct Run {
  std::vector<Device> devices;
  std::optional<RankContext> ranks;
  std::shared_ptr<models::GPT> model;
  nn::ModulePtr net;  // the model, or its DDP wrapper
  std::shared_ptr<dist::DistributedDataParallel> ddp;
  std::shared_ptr<dist::ShardedDataParallel> sdp;  // --strategy zero
  // --strategy pipeline: the stages (Note [GPT as pipeline stages]).
  std::optional<models::GPTPipelineLayers> tied;
  std::shared_ptr<parallel::Pipeline> pipe;
  std::unique_ptr<optim::AdamW> opt;
  std::unique_ptr<data::TokenWindows> train, val;
  int64_t seq = 0, batch = 0, accum = 1;
  int64_t total_steps = 0;     // this run's own steps from 0 to its end
  int64_t step_tokens = 0;     // the run's reference step (Note [Progress in samples] in run_position.h)
  int64_t schedule_steps = 0;  // the schedule's length in reference steps
  int64_t warmup = 1;          // its warm-up, in reference steps
  double lr = 6e-4;
  std::optional<DType> autocast;
  int world() const { return ranks ? ranks->env.world_size : 1; }
  // Replicas of one process (DataParallel): each takes `batch` sequences.
  int64_t replicas() const { return pipe ? 1 : static_cast<int64_t>(devices.size()); }
  bool leader() const { return !ranks || ranks->leader(); }
  int64_t tokens_per_step() const { return batch * replicas() * seq * accum * world(); }
};

nlohmann::json config_json(const TrainConfig& tc, const GptOptions& g, const Run& r) {
  return {{"model", tc.model}, {"data", tc.data}, {"seq_len", r.seq}, {"batch_size", r.batch},
          {"grad_accum", r.accum}, {"lr", r.lr}, {"precision", tc.precision}, {"seed", tc.seed},
          {"vocab", r.model->config().vocab}, {"context", r.model->config().context}, {"dropout", g.dropout}};
}

}  // namespace

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
      loss = model.loss_of_logits(net.forward(micro[m].first), micro[m].second);
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

void validate_gpt(const TrainConfig& tc, const GptOptions& g) {
  CHORUS_CHECK(is_gpt_model(tc.model), "unknown GPT model '", tc.model, "'");
  CHORUS_CHECK(tc.data.rfind("tokens:", 0) == 0 || text_spec(tc.data), "--data for a GPT must be tokens:GLOB (llm.c ",
               "token files) or text:FILE (a text file's bytes), got '", tc.data, "'");
  CHORUS_CHECK(tc.strategy == "single" || tc.strategy == "ddp" || tc.strategy == "dp" || tc.strategy == "pipeline" ||
                   tc.strategy == "zero",
               "--strategy ", tc.strategy, " is not available for GPT models (single, dp, ddp, zero or pipeline)");
  validate_zero_options(tc);
  CHORUS_CHECK(tc.strategy != "zero" || !g.skip_nan, "--skip-nan is not offered with --strategy zero yet");
  if (tc.strategy == "pipeline") {
    CHORUS_CHECK(!tc.micro_batches || *tc.micro_batches >= 1, "--micro-batches must be at least 1");
    if (tc.schedule) (void)parallel::parse_schedule(*tc.schedule);
    if (tc.balance) {
      CHORUS_CHECK(*tc.balance != "time" && *tc.balance != "memory", "--balance for a GPT is a layer count per stage ",
                   "(the embeddings, each block and the head are layers), e.g. 7,7; the default splits them evenly");
      (void)parse_balance(*tc.balance);
    }
    CHORUS_CHECK(!tc.virtual_stages || tc.schedule.value_or("") == "interleaved",
                 "--virtual-stages goes with --schedule interleaved");
  } else if (!g.mesh) {  // with --mesh: validate_gpt_mesh (they go with pp > 1)
    const char* given = tc.micro_batches ? "--micro-batches" : tc.schedule ? "--schedule" : tc.balance ? "--balance"
                        : tc.virtual_stages ? "--virtual-stages" : nullptr;
    CHORUS_CHECK(given == nullptr, given ? given : "", " goes with --strategy pipeline");
  }
  CHORUS_CHECK(tc.precision == "fp32" || tc.precision == "bf16", "unknown precision '", tc.precision,
               "' (expected fp32 or bf16)");
  CHORUS_CHECK(!g.optimizer_given || tc.optimizer == "adamw", "GPT models train with AdamW (--optimizer ",
               tc.optimizer, " is not offered for them)");
  CHORUS_CHECK(g.seq_len >= 0, "--seq-len must be positive, got ", g.seq_len);
  CHORUS_CHECK(g.grad_accum >= 1, "--grad-accum must be at least 1, got ", g.grad_accum);
  CHORUS_CHECK(g.val_every >= 0, "--val-every must be >= 0, got ", g.val_every);
  CHORUS_CHECK(g.val_windows >= 1, "--val-windows must be at least 1, got ", g.val_windows);
  CHORUS_CHECK(std::isfinite(g.clip) && g.clip >= 0, "--clip must be a number >= 0, got ", g.clip);
  CHORUS_CHECK(std::isfinite(g.min_lr_ratio) && g.min_lr_ratio >= 0 && g.min_lr_ratio <= 1,
               "--min-lr-ratio must be in [0, 1], got ", g.min_lr_ratio);
  CHORUS_CHECK(!g.warmup_steps || *g.warmup_steps >= 0, "--warmup-steps must be >= 0, got ", g.warmup_steps.value_or(0));
  CHORUS_CHECK(g.windows == "sequential" || g.windows == "random", "--windows must be sequential or random, got '",
               g.windows, "'");
  CHORUS_CHECK(g.dropout >= 0 && g.dropout < 1, "--dropout must be in [0, 1), got ", g.dropout);
  CHORUS_CHECK(g.attention == "auto" || g.attention == "fused" || g.attention == "composite",
               "--attention must be auto, fused or composite, got '", g.attention, "'");
  CHORUS_CHECK(!tc.recompute || *tc.recompute == "never" || *tc.recompute == "always",
               "--recompute for a GPT is always (every block recomputes its activations in the backward) or never, got '",
               tc.recompute.value_or(""), "'");
  CHORUS_CHECK(tc.batch_size > 0, "--batch-size must be positive, got ", tc.batch_size);
  CHORUS_CHECK(!tc.steps || *tc.steps > 0, "--steps must be positive, got ", tc.steps.value_or(0));
  CHORUS_CHECK(!tc.lr || (std::isfinite(*tc.lr) && *tc.lr >= 0), "--lr must be a non-negative number");
  CHORUS_CHECK(!tc.resume || tc.checkpoint_dir, "--resume needs --checkpoint-dir");
  CHORUS_CHECK(tc.log_every > 0, "--log-every must be positive, got ", tc.log_every);
  if (tc.trace) (void)parse_trace_steps(tc.trace_steps);
  if (g.mesh) {
    validate_gpt_mesh(tc, g);
    return;
  }
  CHORUS_CHECK(!g.sequence_parallel, "--sequence-parallel needs --mesh with tp > 1");
  if (tc.strategy == "ddp" || tc.strategy == "zero") ddp_launch_env(tc.strategy);
}

nlohmann::ordered_json run_train_gpt(const TrainConfig& tc, const GptOptions& g) {
  validate_gpt(tc, g);
  if (g.mesh) return run_train_gpt_mesh(tc, g);
  const auto t_start = Clock::now();
  Run r;
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
  models::GPTConfig cfg = models::GPTConfig::named(tc.model, vocab, context);
  cfg.dropout = g.dropout;
  cfg.attention = ops::parse_attention_kernel(g.attention);
  cfg.recompute = tc.recompute.value_or("never") == "always";

  // The memory plan, before any rendezvous or allocation: a run that cannot
  // fit stops here, on every rank, with what would (apps/memory_check.h).
  // Pipelines split the model unevenly over their stages: no plan for them.
  std::optional<dist::MemoryPlan> plan;
  if (tc.strategy != "pipeline") {
    const bool ranked = tc.strategy == "ddp" || tc.strategy == "zero";
    const int64_t world = ranked ? ddp_launch_env(tc.strategy).world_size : 1;
    GptRun run{tc.model, tc.strategy, tc.precision, r.batch, r.seq, r.replicas(), world, tc.bucket_mb,
               tc.strategy == "zero" ? tc.zero_stage.value_or(1) : 0, tc.zero_param_dtype.value_or("")};
    MemoryPlanFlags flags = tc.memory;
    flags.quiet = tc.quiet || (ranked && ddp_launch_env(tc.strategy).rank != 0);
    plan = check_gpt_memory_plan(cfg, run, device, flags);
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
    r.pipe = std::make_shared<parallel::Pipeline>(r.tied->layers(), tc.balance ? parse_balance(*tc.balance)
                                                                                : std::vector<int64_t>{},
                                                  r.devices, po);
    r.net = r.pipe;
    if (!tc.quiet) {
      std::string bal, devs;
      for (int64_t b : r.pipe->balance()) bal += (bal.empty() ? "" : ",") + std::to_string(b);
      for (const Device& d : r.devices) devs += (devs.empty() ? "" : ",") + d.str();
      std::fprintf(stderr, "pipeline: %lld layers (embeddings, %lld blocks, head) in %lld stages (%s) over %s, "
                   "%lld micro-batches, schedule %s\n", (long long)r.tied->layers()->size(), (long long)cfg.layers,
                   (long long)r.pipe->num_stages(), bal.c_str(), devs.c_str(), (long long)po.micro_batches,
                   tc.schedule.value_or("1f1b").c_str());
    }
  }
  if (r.ranks) {
    // Note [Options every rank shares] (train_dist.h): the settings every rank
    // must train with, and the data each reads, compared before any collective.
    nlohmann::json fp = config_json(tc, g, r);
    fp["weight_decay"] = g.weight_decay_given ? tc.weight_decay : 0.1;
    fp["strategy"] = tc.strategy;
    fp["zero_stage"] = tc.zero_stage.value_or(0);
    fp["reshard_after_forward"] = tc.reshard_after_forward;
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
  std::vector<Tensor> params;
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
  int64_t start = 0, start_tokens = 0;
  if (tc.resume) {
    const nlohmann::json mine = config_json(tc, g, r);
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
  const double peak = device.is_cuda() ? bf16_peak_flops(backend(device).device_name(device)) : 0.0;
  const double flops_per_step = cfg.flops_per_token(r.seq) * static_cast<double>(r.tokens_per_step());
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

  auto val_loss = [&]() -> double {
    if (!r.val) return std::nan("");
    if (r.sdp) r.sdp->gather_parameters();  // the module's own forward, outside the wrapper
    r.model->eval();
    NoGradGuard no_grad;
    AutocastGuard cast(r.autocast);
    auto [ids, tg] = r.val->spaced(g.val_windows);
    double total = 0;
    int64_t n = 0;
    for (int64_t b = 0; b < ids.size(0); b += r.batch) {
      const int64_t m = std::min(r.batch, ids.size(0) - b);
      Tensor x = ids.narrow(0, b, m).to(device), y = tg.narrow(0, b, m).to(device);
      // Through the stages where they are (a pipeline's model spans devices).
      Tensor l = r.pipe ? r.model->loss_of_logits(r.pipe->forward(x), y.to(r.pipe->devices().back()))
                        : r.model->loss(x, y);
      total += l.item() * static_cast<double>(m);
      n += m;
    }
    r.model->train();
    return total / static_cast<double>(n);
  };

  auto step_forward_backward = [&](const std::vector<std::pair<Tensor, Tensor>>& micro) {
    return r.pipe ? pipeline_forward_backward(*r.model, *r.pipe, *r.tied, micro, r.autocast)
                  : gpt_forward_backward(*r.model, *r.net, r.ddp.get(), micro, r.autocast, r.sdp.get());
  };
  // The whole step (forward, backward, clipping, AdamW) as one CUDA graph on a
  // GPU (Note [Graphed step] in parallel/graphed_step.h; DDP's all-reduces
  // inside it), eager on CPUs or with --no-cuda-graphs.
  // Under --strategy zero the global norm is over every rank's pieces.
  auto clip = [&](double max_norm) { return r.sdp ? r.sdp->clip_grad_norm(max_norm) : optim::clip_grad_norm_(params, max_norm); };
  parallel::GraphedStepOptions go;
  // Sharded steps too (Note [Sharded steps in a CUDA graph] in dist/sharded.h):
  // the gathers and reduce-scatters are captured with the rest; a step that
  // reads the used-flags on the host cannot be, and falls back to eager.
  go.enabled = device.is_cuda() && !tc.no_cuda_graphs;
  go.devices = r.devices;  // DataParallel: one graph over its devices
  go.on_fallback = [&r](const std::string& line) {
    if (r.leader()) std::fprintf(stderr, "%s\n", line.c_str());
  };
  auto graphed = std::make_unique<parallel::GraphedStep>(
      [&](const std::vector<Tensor>& in) {
        Tensor loss = step_forward_backward(pairs_of(in));
        Tensor norm = clip(g.clip);
        r.opt->step();
        r.opt->zero_grad();
        if (r.tied) r.tied->sync_tied_weights();
        return std::vector<Tensor>{loss, norm};
      },
      go);
  Progress progress(r.leader() && !tc.quiet);
  std::vector<Tensor> window_losses;  // this log window's per-step losses, on the device
  Tensor last_norm;
  double last_loss = std::nan(""), last_val = std::nan(""), tok_s = 0, mfu = 0;
  int64_t val_step = -1;  // the step last_val was measured at
  auto window_start = Clock::now();
  int64_t window_first = start;
  // Every log window's time and steps (validation left out): the mean step
  // the checkpoints' stall is compared with.
  double timed_secs = 0;
  int64_t timed_steps = 0;
  auto mean_step_ms = [&] { return timed_steps > 0 ? 1000 * timed_secs / static_cast<double>(timed_steps) : 0.0; };
  // The fastest log window's step: past the warm-up and capture, and not
  // slowed by a checkpoint waiting for the previous one's write.
  double fastest_step_ms = 0;
  io::ShardedCheckpointWriter::Totals ckpt_stall;
  // --trace (Note [Traces of several ranks]: every rank records, rank 0
  // writes the file) and --stats-every (the slowest rank named, Note [Late
  // arrivals] in apps/train_dist.h), as the image trainer does.
  StepTracer tracer(tc.trace, tc.trace_steps, r.ranks ? r.ranks->group->store() : nullptr,
                    r.ranks ? r.ranks->env.rank : 0, r.world(), !tc.quiet);
  RankTimes rank_times;
  auto last_report = Clock::now();
  backend(device).reset_peak_bytes(device);
  StopSignal stop_signal;  // Note [Stopping on a signal]
  int64_t step = start;
  // Tokens consumed when this run's step `s` begins.
  auto tokens_at = [&](int64_t s) { return start_tokens + (s - start) * r.tokens_per_step(); };
  std::string ckpt;
  // --strategy zero: sharded checkpoints (apps/sharded_checkpoints.h).
  std::unique_ptr<ShardedCheckpointer> sharded_ckpt;
  if (r.sdp && tc.checkpoint_dir) sharded_ckpt = std::make_unique<ShardedCheckpointer>(*tc.checkpoint_dir, r.sdp, *r.opt, *r.ranks);
  auto save = [&](int64_t s) {
    if (!tc.checkpoint_dir) return;
    io::TrainingState st;
    st.step = reference_step(tokens_at(s), r.step_tokens);  // the name, by position
    st.rng = default_generator().state();
    st.config = config_json(tc, g, r);
    st.extra = {{kTokenKeys.consumed, tokens_at(s)}, {kTokenKeys.per_step, r.step_tokens}, {"world_size", r.world()}};
    if (sharded_ckpt) {
      // Every rank: its pieces snapshotted on its device (the stall), copied
      // to host memory and written in the background; the ranks commit
      // through the job's store.
      const double stall = sharded_ckpt->save(st);
      ckpt = *tc.checkpoint_dir + "/" + io::checkpoint_name(st.step);
      if (r.leader() && !tc.quiet)
        std::fprintf(stderr, "checkpoint %s: training stalled %.1f ms (%s)\n", ckpt.c_str(), stall,
                     snapshot_where(sharded_ckpt->writer().last_snapshot_devices()).c_str());
      return;
    }
    if (r.leader()) ckpt = io::save_checkpoint(*tc.checkpoint_dir, *r.model, *r.opt, st);
    if (r.ranks) r.ranks->group->barrier()->wait();
  };

  for (; step < r.total_steps; ++step) {
    r.opt->set_lr(lr_at_position(
        [&](int64_t k) { return lr_at(k, r.schedule_steps, r.warmup, r.lr, g.min_lr_ratio); }, tokens_at(step),
        r.step_tokens));
    tracer.begin_step(step + 1);
    const auto step_begin = Clock::now();
    std::vector<Tensor> inputs;  // ids, targets of each micro-batch
    {
      ops::TraceScope data("data");
      for (int64_t m = 0; m < r.accum; ++m) {
        auto [ids, tg] = r.train->batch(r.batch * r.replicas(), step * r.accum + m);
        inputs.push_back(ids.to(device));
        inputs.push_back(tg.to(device));
      }
    }
    const auto data_end = Clock::now();
    Tensor step_loss;
    if (g.skip_nan) {
      // The loss is read before the update, which may then be skipped: eager steps.
      {
        ops::TraceScope fb("forward+backward");
        step_loss = step_forward_backward(pairs_of(inputs));
      }
      if (std::isnan(step_loss.item())) {
        if (r.leader()) std::fprintf(stderr, "step %lld: the loss is NaN, step skipped (--skip-nan)\n", (long long)step);
        r.opt->zero_grad();
        continue;
      }
      ops::TraceScope opt("optimizer");
      last_norm = clip(g.clip);
      r.opt->step();
      r.opt->zero_grad();
      if (r.tied) r.tied->sync_tied_weights();
    } else {
      // One span: a replayed graph has no host phases of its own.
      ops::TraceScope whole(graphed->replays() > 0 ? "step (CUDA graph)" : "forward+backward+optimizer");
      std::vector<Tensor> out = (*graphed)(inputs);  // Note [Graphed step]: replayed after its warm-up
      step_loss = out[0];
      last_norm = out[1];
    }
    tracer.end_step(step + 1);
    if (r.ranks)
      rank_times.add_step(std::chrono::duration<double>(Clock::now() - step_begin).count(),
                          std::chrono::duration<double>(data_end - step_begin).count());
    window_losses.push_back(step_loss);
    // Note [Measured beside the plan]: the peak of the first two steps
    // beside the plan (the allocator counts on the host as the work is
    // issued: no wait for the device).
    if (plan && r.leader() && (step == start + 1 || (step == start && step + 1 == r.total_steps)))
      std::fprintf(stderr, "%s\n", dist::measured_line(*plan, static_cast<int64_t>(backend(device).peak_bytes(device))).c_str());
    const bool last = step + 1 == r.total_steps;
    const bool read = (step + 1) % tc.log_every == 0 || last;
    bool stop = false;
    if (read) {
      if (r.ranks) rank_times.arrive();  // Note [Late arrivals]: before the wait for the device
      // One host wait per window: every step's loss of the window at once.
      std::vector<double> ls;
      for (const Tensor& l : window_losses) ls.push_back(l.item());
      double sum = 0;
      for (size_t i = 0; i < ls.size(); ++i) {
        CHORUS_CHECK(!std::isnan(ls[i]), "the loss is NaN at step ", window_first + static_cast<int64_t>(i) + 1,
                     " (nothing was saved after it; lower --lr, or pass --skip-nan to skip such steps)");
        sum += ls[i];
      }
      double mean = sum / static_cast<double>(ls.size());
      stop = StopSignal::pending() != 0;
      bool report = false;  // rank 0 decides, the window's all-reduce tells the others
      if (r.ranks) {
        const bool due = r.leader() && tc.stats_every_s > 0 &&
                         std::chrono::duration<double>(Clock::now() - last_report).count() >= tc.stats_every_s;
        auto s = sum_over_ranks(*r.ranks, {mean, stop ? 1.0 : 0.0, due ? 1.0 : 0.0});
        mean = s[0] / r.world();
        stop = s[1] > 0;
        report = s[2] > 0;
      }
      if (report) {
        const std::string line = rank_times.report(*r.ranks, step + 1, r.ddp ? r.ddp->gradient_wait_seconds() : 0.0);
        last_report = Clock::now();
        if (!line.empty() && !tc.quiet) std::fprintf(stderr, "%s\n", line.c_str());
      }
      last_loss = mean;
      const double secs = seconds_since(window_start);
      const int64_t steps_done = step + 1 - window_first;
      timed_secs += secs;
      timed_steps += steps_done;
      const double window_step_ms = 1000 * secs / static_cast<double>(std::max<int64_t>(steps_done, 1));
      if (fastest_step_ms == 0 || window_step_ms < fastest_step_ms) fastest_step_ms = window_step_ms;
      tok_s = static_cast<double>(steps_done * r.tokens_per_step()) / std::max(secs, 1e-9);
      mfu = peak > 0 ? flops_per_step * static_cast<double>(steps_done) / secs / (peak * static_cast<double>(r.world() * r.replicas())) : 0.0;
      const double norm = last_norm.item();
      if (r.val && g.val_every && ((step + 1) % g.val_every == 0)) {
        last_val = val_loss();
        val_step = step + 1;
      }
      if (r.leader() && !tc.quiet) {
        char line[512];
        std::snprintf(line, sizeof line, "step %lld/%lld | loss %.4f | ppl %.2f | lr %.2e | norm %.3f | %s tok/s",
                      (long long)(step + 1), (long long)r.total_steps, mean, std::exp(mean), r.opt->lr(), norm,
                      fmt_count(tok_s).c_str());
        std::string s = line;
        if (peak > 0) {
          std::snprintf(line, sizeof line, " | MFU %.1f%%", 100 * mfu);
          s += line;
        }
        if (!std::isnan(last_val)) {
          std::snprintf(line, sizeof line, " | val %.4f", last_val);
          s += line;
        }
        const double eta = secs / static_cast<double>(steps_done) * static_cast<double>(r.total_steps - step - 1);
        s += " | ETA " + Progress::format_duration(eta);
        std::fprintf(stderr, "%s\n", s.c_str());
      }
      if (log.any()) {
        nlohmann::ordered_json rec = {{"step", step + 1}, {"tokens", tokens_at(step + 1)}, {"loss", mean}, {"lr", r.opt->lr()}, {"grad_norm", norm},
                                      {"tok_per_s", tok_s}};
        if (peak > 0) rec["mfu"] = mfu;
        rec["ppl"] = std::exp(mean);
        rec["peak_mem_bytes"] = backend(device).peak_bytes(device);
        log.step(rec);
        if (val_step == step + 1) log.epoch({{"step", step + 1}, {"test_loss", last_val}});
      }
      window_losses.clear();
      window_start = Clock::now();
      window_first = step + 1;
    }
    if (tc.checkpoint_every > 0 && (step + 1) % tc.checkpoint_every == 0 && !last) save(step + 1);
    if (stop) {
      ++step;
      if (r.leader()) std::fprintf(stderr, "stopping after step %lld on a signal\n", (long long)step);
      break;
    }
  }
  tracer.finish();
  save(step);
  if (sharded_ckpt) {
    // The last checkpoint is whole on disk before the run reports it (or stops).
    sharded_ckpt->wait();
    if (r.leader() && !tc.quiet)
      std::fprintf(stderr, "checkpoint %s: written in %.0f ms\n", ckpt.c_str(), sharded_ckpt->last_write_ms());
    ckpt_stall = sharded_ckpt->writer().totals();
    if (r.leader() && !tc.quiet && ckpt_stall.saves > 0)
      std::fprintf(stderr, "%s\n", stall_summary(ckpt_stall, fastest_step_ms > 0 ? fastest_step_ms : mean_step_ms()).c_str());
  }
  if (const int sig = StopSignal::pending(); sig != 0 && step < r.total_steps) {
    if (r.leader())
      std::fprintf(stderr, "%s", ckpt.empty() ? "no --checkpoint-dir: nothing was saved\n"
                                                : ("checkpoint written: " + ckpt + "\n").c_str());
    throw Interrupted(sig);
  }
  if (r.val && val_step != step) {
    last_val = val_loss();
    val_step = step;
    log.epoch({{"step", step}, {"test_loss", last_val}});
  }
  if (g.save_hf) {
    NamedTensors state = r.model->state_dict();
    if (r.sdp) {
      // The masters, whole (a collective: every rank): under --strategy zero
      // the module holds shards, or bf16 weights while gathered.
      std::map<std::string, Tensor> full;
      for (auto& [name, t] : r.sdp->full_parameters()) full[name] = t;
      for (auto& [name, t] : state)
        if (auto it = full.find(name); it != full.end()) t = it->second;
    }
    if (r.leader()) io::save_safetensors(*g.save_hf, models::gpt_to_hf(state, cfg));
  }
  const double peak_mem = static_cast<double>(backend(device).peak_bytes(device));

  nlohmann::ordered_json out = {{"model", tc.model},
                                {"strategy", tc.strategy},
                                {"devices", r.world() > 1 ? std::to_string(r.world()) + " ranks"
                                            : r.devices.size() > 1 ? std::to_string(r.devices.size()) + " devices"
                                                                   : device.str()},
                                {"precision", tc.precision},
                                {"params", n_params},
                                {"seq_len", r.seq},
                                {"batch_per_device", r.batch},
                                {"grad_accum", r.accum},
                                {"steps", step},
                                {"tokens", tokens_at(step)},
                                {"train_loss", last_loss},
                                {"val_loss", std::isnan(last_val) ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(last_val)},
                                {"val_ppl", std::isnan(last_val) ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(std::exp(last_val))},
                                {"tok_per_s", tok_s},
                                {"mfu", peak > 0 ? nlohmann::ordered_json(mfu) : nlohmann::ordered_json(nullptr)},
                                {"peak_mem_bytes", peak_mem},
                                {"seconds", seconds_since(t_start)}};
  if (!ckpt.empty()) out["checkpoint"] = ckpt;
  if (ckpt_stall.saves > 0)
  {
    out["checkpoint_stall_ms"] = (ckpt_stall.stall_ms + ckpt_stall.device_ms) / static_cast<double>(ckpt_stall.saves);
    out["checkpoint_wait_ms"] = ckpt_stall.wait_ms;  // all saves' waits for earlier writes
  }
  log.summary(out);
  if (r.leader() && !tc.quiet) {
    std::fprintf(stderr, "done: %lld steps, train loss %.4f", (long long)step, last_loss);
    if (!std::isnan(last_val)) std::fprintf(stderr, ", val loss %.4f (ppl %.2f)", last_val, std::exp(last_val));
    std::fprintf(stderr, ", %s tok/s, %.1f s\n", fmt_count(tok_s).c_str(), seconds_since(t_start));
  }
  if (!r.leader()) return nullptr;
  return out;
}

}  // namespace chorus::app
