// `chorus train --model gpt2|... --mesh dp=A,pp=B,tp=C`: the GPT driver over
// a device mesh (distributed/device_mesh.h). Each tensor-parallel group holds one
// copy of the model split Megatron-style (tensor_parallel/gpt.h), or with
// pp > 1 pipeline stages of it (Note [GPT pipelines over the mesh] in
// gpt_mesh.h: --micro-batches, --schedule 1f1b|gpipe|interleaved,
// --virtual-stages, --balance); the data
// ranks (the dp axis) read disjoint windows and average their gradients (with
// DistributedDataParallel over their dp group, or after the pipeline's
// backwards). Clipping is by the whole model's norm (tensor_parallel/
// clip_grad.h), checkpoints are in the one-process format (Note [Mesh
// checkpoints]). The schedule, optimizer groups, data and figures are
// train_gpt.cpp's.
//
// Launched as every multi-process run is: chorus launch --nproc-per-node 4 --
// chorus train --model d12 --mesh pp=2,tp=2 ... (or torchrun, mpirun, srun).
#include <chrono>
#include <cmath>
#include <cstdio>

#include "chorus/autograd/autocast.h"
#include "chorus/autograd/grad_mode.h"
#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/core/rng.h"
#include "chorus/data/tokens.h"
#include "chorus/data_parallel/ddp.h"
#include "chorus/distributed/device_mesh.h"
#include "chorus/io/dir_lock.h"
#include "chorus/io/safetensors.h"
#include "chorus/ops/factory.h"
#include "chorus/ops/profile.h"
#include "chorus/optim/adamw.h"
#include "chorus/parallel/placement.h"
#include "chorus/tensor_parallel/clip_grad.h"
#include "chorus/tensor_parallel/gpt.h"
#include "gpt_loop_window.h"
#include "gpt_mesh.h"
#include "gpt_mesh_checkpoint.h"
#include "run_position.h"
#include "step_trace.h"
#include "stop_signal.h"
#include "train_dist.h"
#include "train_gpt.h"
#include "train_pipeline.h"

namespace chorus::app {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

nlohmann::json mesh_config_json(const TrainConfig& tc, const GptOptions& g, const models::GPTConfig& cfg, int64_t seq,
                                 int64_t batch, int64_t accum, double lr) {
  // The keys train_gpt.cpp writes, so that a run without --mesh resumes it.
  return {{"model", tc.model}, {"data", tc.data}, {"seq_len", seq}, {"batch_size", batch},
          {"grad_accum", accum}, {"lr", lr}, {"precision", tc.precision}, {"seed", tc.seed},
          {"vocab", cfg.vocab}, {"context", cfg.context}, {"dropout", g.dropout}};
}

}  // namespace

void validate_gpt_mesh(const TrainConfig& tc, const GptOptions& g) {
  dist::parse_mesh_spec(*g.mesh);
  CHORUS_CHECK(tc.strategy == "single" || tc.strategy == "ddp", "--mesh sets the layout itself: --strategy ",
               tc.strategy, " cannot go with it (leave --strategy out)");
  CHORUS_CHECK(!g.skip_nan, "--skip-nan is not offered with --mesh yet");
  CHORUS_CHECK(!tc.recompute || *tc.recompute == "never", "--recompute is not offered with --mesh yet");
  CHORUS_CHECK(!g.recompute_gelu, "--recompute-gelu is not offered with --mesh yet");
  CHORUS_CHECK(!g.save_hf, "--save-hf is not offered with --mesh yet (convert the checkpoint without --mesh)");
  CHORUS_CHECK(tc.precision == "fp32" || tc.precision == "bf16", "unknown precision '", tc.precision, "'");
  CHORUS_CHECK(!tc.metrics && !tc.tensorboard && !tc.plot,
               "--metrics, --tensorboard and --plot are not offered with --mesh yet (the progress lines and --json are)");
  const int pp = mesh_axis_size(dist::parse_mesh_spec(*g.mesh), "pp");
  CHORUS_CHECK(!tc.virtual_stages || tc.schedule.value_or("") == "interleaved",
               "--virtual-stages goes with --schedule interleaved");
  if (pp == 1) {
    const char* given = tc.micro_batches ? "--micro-batches" : tc.schedule ? "--schedule"
                        : tc.balance     ? "--balance"
                        : tc.virtual_stages ? "--virtual-stages" : nullptr;
    CHORUS_CHECK(given == nullptr, given ? given : "", " goes with pipeline stages: --mesh pp=N with N > 1");
  } else {
    CHORUS_CHECK(tc.comm_hook == "allreduce", "--comm-hook ", tc.comm_hook,
                 " is not offered with --mesh pp= (the data ranks average the stages' gradients in full precision)");
    if (tc.schedule) (void)parallel::parse_schedule(*tc.schedule);
    if (tc.balance) {
      CHORUS_CHECK(*tc.balance != "time" && *tc.balance != "memory", "--balance for a GPT is a layer count per stage ",
                   "(the embeddings, each block and the head are layers), e.g. 7,7; the default splits them evenly");
      (void)parse_balance(*tc.balance);
    }
  }
}

nlohmann::ordered_json run_train_gpt_mesh(const TrainConfig& tc, const GptOptions& g) {
  const auto t_start = Clock::now();
  MeshSettings ms;
  ms.spec = *g.mesh;
  ms.sequence_parallel = g.sequence_parallel;
  ms.tp_chunks = g.tp_chunks;
  ms.allow_tp_across_nodes = g.allow_tp_across_nodes;
  ms.devices = tc.devices;
  ms.timeout_s = tc.dist_timeout_s;
  ms.seed = tc.seed;
  ms.quiet = tc.quiet;

  // The model's shape first: a tp that does not fit it is refused before any
  // process group exists (every rank says the same one line).
  const int64_t seq = seq_len_of(tc, g);
  auto train_stream = data::TokenStream::open(train_spec(tc.data));
  const int64_t vocab = train_stream->natural_vocab() ? train_stream->natural_vocab() : 50257;
  CHORUS_CHECK(train_stream->max_token() < vocab, "token data ", train_stream->spec(), " holds token id ",
               train_stream->max_token(), ", past the model's vocabulary of ", vocab, " tokens");
  const int64_t context = text_spec(tc.data) ? seq : 1024;
  CHORUS_CHECK(seq <= context, "--seq-len ", seq, " is above ", tc.model, "'s context of ", context, " positions");
  models::GPTConfig cfg = models::GPTConfig::named(tc.model, vocab, context);
  cfg.dropout = g.dropout;
  cfg.attention = ops::parse_attention_kernel(g.attention);
  const auto axes = check_mesh_gpt(ms, cfg, seq);
  const int tp_size = axes.back().size;  // parse_mesh_spec's order: dp, pp, tp
  const int pp = mesh_axis_size(axes, "pp");
  const int64_t batch = g.batch_given ? tc.batch_size : 8, accum = g.grad_accum;
  MeshPipeSettings ps;
  if (pp > 1) {
    ps.micro_batches = tc.micro_batches.value_or(std::max<int64_t>(4, pp));
    ps.schedule = tc.schedule.value_or("1f1b");
    if (ps.schedule == "interleaved") ps.virtual_stages = tc.virtual_stages.value_or(2);
    if (tc.balance) ps.balance = parse_balance(*tc.balance);
    check_mesh_pipeline(axes, cfg, ps, batch);
  }

  MeshGpt m = start_mesh_gpt(ms, cfg, seq);
  const Device device = m.device;
  CHORUS_CHECK(tc.precision == "fp32" || device.is_cuda(), "--precision bf16 needs a CUDA device (got ", device.str(), ")");
  RankContext& rc = m.rc;
  const bool leader = rc.leader();
  const int dp = m.dp(), dp_rank = m.dp_rank();
  auto& model = m.model;
  tp::TPContext& ctx = m.ctx;
  if (g.init_from) tp::load_full_state_dict(*model, models::gpt_from_hf(io::load_safetensors(*g.init_from), cfg), ctx.group);

  // Data: one stream of windows per data rank, read alike by its tensor ranks.
  const data::WindowOrder order = g.windows == "random" ? data::WindowOrder::Random : data::WindowOrder::Sequential;
  data::TokenWindows train(train_stream, seq, dp_rank, dp, tc.seed, order);
  std::unique_ptr<data::TokenWindows> val;
  if (const std::string vs = val_spec(tc.data, g.val_data); !vs.empty()) {
    auto stream = data::TokenStream::open(vs);
    CHORUS_CHECK(stream->max_token() < vocab, "validation data ", stream->spec(), " holds token id ",
                 stream->max_token(), ", past the model's vocabulary of ", vocab, " tokens");
    val = std::make_unique<data::TokenWindows>(stream, seq, 0, 1, tc.seed, data::WindowOrder::Sequential);
  }

  const double lr = tc.lr.value_or(6e-4);
  const double wd = g.weight_decay_given ? tc.weight_decay : 0.1;
  // Before the optimizer: the pipeline moves this rank's stage to its device.
  std::optional<MeshPipeline> mp;
  if (pp > 1) mp.emplace(start_mesh_pipeline(m, ps, seq));
  optim::AdamWOptions ao{lr, 0.9, 0.95, 1e-8, wd};
  const auto sharded = tp::sharded_parameters(*model);
  std::vector<Tensor> params;
  for (const auto& p : sharded) {
    params.push_back(p.tensor);
    const bool embedding = p.name.find(".wte.") != std::string::npos || p.name.find(".wpe.") != std::string::npos;
    ao.param_weight_decay.push_back(p.tensor.dim() >= 2 && (!embedding || g.decay_embeddings) ? wd : 0.0);
  }
  optim::AdamW opt(params, ao);

  nlohmann::json fp = mesh_config_json(tc, g, cfg, seq, batch, accum, lr);
  fp["mesh"] = dist::mesh_spec_str(axes);
  fp["sequence_parallel"] = g.sequence_parallel;
  fp["tp_chunks"] = g.tp_chunks;
  fp["clip"] = g.clip;
  if (pp > 1)
    fp["pipeline"] = {{"micro_batches", ps.micro_batches}, {"schedule", ps.schedule},
                      {"virtual_stages", ps.virtual_stages}, {"balance", mp->pipe->balance()}};
  fp["steps"] = tc.steps ? *tc.steps : -1;
  fp["train_data"] = {{"tokens", train_stream->size()}};
  check_same_options(rc, fp);  // Note [Options every rank shares]

  nn::ModulePtr net = model;
  std::shared_ptr<dist::DistributedDataParallel> ddp;
  if (dp > 1 && pp == 1) {
    dist::DDPOptions o;
    o.bucket_bytes = static_cast<int64_t>(tc.bucket_mb * (1 << 20));
    o.comm_hook = dist::parse_comm_hook(tc.comm_hook);
    net = ddp = std::make_shared<dist::DistributedDataParallel>(model, m.mesh->group("dp"), o);
  }

  const int64_t tokens_per_step = batch * seq * accum * dp;
  const int64_t per_epoch = std::max<int64_t>(1, train.windows_per_rank() / (batch * accum));
  const int64_t total_steps = tc.steps ? *tc.steps : per_epoch * tc.epochs;
  const int64_t warmup = g.warmup_steps ? std::max<int64_t>(*g.warmup_steps, 0) : std::max<int64_t>(1, total_steps / 20);

  std::optional<io::CheckpointDirLock> dir_lock;
  if (leader && tc.checkpoint_dir) dir_lock.emplace(*tc.checkpoint_dir);
  int64_t start = 0;
  if (tc.resume) {
    const nlohmann::json mine = mesh_config_json(tc, g, cfg, seq, batch, accum, lr);
    const std::string path =
        agree_on_checkpoint(rc, leader ? io::find_latest_checkpoint(*tc.checkpoint_dir) : std::nullopt);
    if (!path.empty()) {
      io::TrainingState st = load_mesh_checkpoint(path, *model, opt, [&](const io::TrainingState& s, const std::string& p) {
        for (const char* k : {"model", "seq_len", "vocab", "context"})
          CHORUS_CHECK(s.config.contains(k) && s.config[k] == mine[k], "checkpoint ", p, " was written with ", k, " = ",
                       s.config.contains(k) ? s.config[k].dump() : "(none)", ", this run has ", mine[k].dump());
      });
      // Note [Progress in samples] (run_position.h): the position is the tokens consumed.
      const SavedPosition at = read_position(st.extra, kTokenKeys, st.step, tokens_per_step, path + "/state.json");
      start = at.consumed / tokens_per_step;
      tp::seed_parallel_rng(ctx, tc.seed + static_cast<uint64_t>(start), dp_rank);
      if (leader) std::fprintf(stderr, "resumed from %s at step %lld\n", path.c_str(), (long long)start);
    }
  }
  if (leader && !tc.quiet && mp) {
    std::fprintf(stderr, "pipeline: %lld layers (embeddings, %lld blocks, head) in %lld stages (%s) over pp=%d%s, "
                 "%lld micro-batches, schedule %s\n", (long long)cfg.layers + 2, (long long)cfg.layers,
                 (long long)mp->pipe->num_stages(), parallel::balance_str(mp->pipe->balance()).c_str(), pp,
                 ps.virtual_stages > 1 ? (", " + std::to_string(ps.virtual_stages) + " per rank").c_str() : "",
                 (long long)ps.micro_batches, ps.schedule.c_str());
  }
  if (leader && !tc.quiet) {
    std::fprintf(stderr, "%s: %.1fM parameters over tp=%d%s, seq %lld, batch %lld x %lld accum x dp %d = %s tokens/step, "
                 "%lld steps, %s on %s\n", tc.model.c_str(), static_cast<double>(cfg.num_parameters()) / 1e6, tp_size,
                 g.sequence_parallel ? " (sequence parallel)" : "", (long long)seq, (long long)batch, (long long)accum, dp,
                 fmt_count(static_cast<double>(tokens_per_step)).c_str(), (long long)total_steps, tc.precision.c_str(),
                 device.str().c_str());
  }

  std::optional<DType> autocast;
  if (tc.precision == "bf16") autocast = kBFloat16;
  std::string ckpt;
  auto save = [&](int64_t s) {
    if (!tc.checkpoint_dir) return;
    io::TrainingState st;
    st.step = s;
    st.rng = default_generator().state();
    st.config = mesh_config_json(tc, g, cfg, seq, batch, accum, lr);
    st.extra = {{kTokenKeys.consumed, s * tokens_per_step}, {kTokenKeys.per_step, tokens_per_step},
                {"world_size", dp}, {"mesh", dist::mesh_spec_str(axes)}};
    // Every rank gathers; world rank 0 writes (it is tensor rank 0 of data rank 0).
    std::optional<StageOwners> stages;
    if (mp) stages = StageOwners{m.mesh->group("pp"), mp->owner};
    const std::string p = save_mesh_checkpoint(*tc.checkpoint_dir, *model, opt, st, leader, stages ? &*stages : nullptr);
    if (leader) ckpt = p;
    rc.group->barrier()->wait();
  };
  auto val_loss = [&]() -> double {
    // Every rank evaluates the same windows: its tensor group needs it in each collective.
    if (!val) return std::nan("");
    model->eval();
    NoGradGuard no_grad;
    AutocastGuard cast(autocast);
    auto [ids, tg] = val->spaced(g.val_windows);
    double total = 0;
    for (int64_t b = 0; b < ids.size(0); b += batch) {
      const int64_t n = std::min(batch, ids.size(0) - b);
      const Tensor x = ids.narrow(0, b, n).to(device), t = tg.narrow(0, b, n).to(device);
      if (!mp) {
        total += model->loss(x, t).item() * static_cast<double>(n);
      } else if (Tensor l = mp->pipe->evaluate(x, t, [&](const Tensor& out, const Tensor& y) {
                   return model->loss_of_logits(out, y);
                 }); l.defined()) {
        total += l.item() * static_cast<double>(n);
      }
    }
    model->train();
    // Pipeline stages: the last stage's ranks hold the loss, the others add 0.
    if (mp) total = sum_over_ranks(rc, {total})[0] / static_cast<double>(rc.group->size() / pp);
    return total / static_cast<double>(ids.size(0));
  };

  double last_loss = std::nan(""), last_val = std::nan(""), tok_s = 0;
  int64_t step = start;
  LogWindow window(start);
  StopSignal stop_signal;  // Note [Stopping on a signal]: agreed on at the log windows, as train_gpt.cpp does
  // --trace and --stats-every as train_gpt.cpp has them: every rank records
  // its phases, and its groups' collectives each on a track of their own
  // (ProcessGroup::trace_track: "gloo tp", "gloo dp", ...), rank 0 writes the
  // one file (Note [Traces of several ranks]); rank 0 names the slowest rank
  // (Note [Slow ranks named]).
  StepTracer tracer(tc.trace, tc.trace_steps, rc.group->store(), rc.env.rank, rc.group->size(), !tc.quiet);
  RankTimes rank_times;
  auto last_report = Clock::now();
  for (; step < total_steps; ++step) {
    opt.set_lr(lr_at(step, total_steps, warmup, lr, g.min_lr_ratio));
    tracer.begin_step(step + 1);
    const auto step_begin = Clock::now();
    double data_s = 0;
    Tensor step_loss;
    for (int64_t m = 0; m < accum; ++m) {
      const auto data_begin = Clock::now();
      Tensor x, y;
      {
        ops::TraceScope data("data");
        auto [ids, tg] = train.batch(batch, step * accum + m);
        x = ids.to(device);
        y = tg.to(device);
      }
      data_s += seconds_since(data_begin);
      std::optional<dist::DistributedDataParallel::NoSync> quiet;
      if (ddp && m + 1 < accum) quiet.emplace(ddp->no_sync());
      Tensor l;
      if (mp) {
        // The schedule's forwards, backwards and point-to-point waits in one phase (pipeline.h has no trace hooks).
        ops::TraceScope pipe("pipeline");
        AutocastGuard cast(autocast);
        const double w = 1.0 / static_cast<double>(accum);
        // Defined on the last stage's ranks; the others count 0 (Note [GPT pipelines over the mesh]).
        l = mp->pipe->train_step(x, y, [&](const Tensor& out, const Tensor& t) {
                  Tensor lm = model->loss_of_logits(out, t);
                  return accum > 1 ? lm.mul(w) : lm;
                }).loss;
        if (!l.defined()) l = zeros({}, {kFloat32, device});
      } else {
        Tensor loss;
        {
          ops::TraceScope forward("forward");
          AutocastGuard cast(autocast);
          loss = model->loss_of_logits(net->forward(x), y);
        }
        {
          ops::TraceScope backward("backward");
          (accum > 1 ? loss.mul(1.0 / static_cast<double>(accum)) : loss).backward();
        }
        l = loss.detach().mul(1.0 / static_cast<double>(accum));
      }
      step_loss = step_loss.defined() ? step_loss.add(l.to(step_loss.dtype())) : l;
    }
    if (mp) {
      ops::TraceScope reduce("reduce_gradients");
      reduce_pipeline_gradients(m, *mp);
    }
    Tensor norm;
    {
      ops::TraceScope optimizer("optimizer");
      norm = clip_mesh_gradients(m, mp ? &*mp : nullptr, sharded, g.clip);
      opt.step();
      opt.zero_grad();
    }
    tracer.end_step(step + 1);
    rank_times.add_step(seconds_since(step_begin), data_s);
    window.losses.push_back(step_loss);
    const bool last = step + 1 == total_steps;
    bool stop = false;
    if ((step + 1) % tc.log_every == 0 || last) {
      rank_times.arrive();  // Note [Late arrivals]: before the wait for the device
      double sum = 0;
      for (const Tensor& l : window.losses) sum += l.item();
      const int64_t n = static_cast<int64_t>(window.losses.size());
      const bool due = leader && tc.stats_every_s > 0 && seconds_since(last_report) >= tc.stats_every_s;
      // Tensor ranks hold the same loss: the mean over the world is the mean
      // over the data ranks (pipeline stages: only the last one's ranks hold it).
      const auto summed = sum_over_ranks(rc, {sum / static_cast<double>(n), StopSignal::pending() ? 1.0 : 0.0, due ? 1.0 : 0.0});
      last_loss = summed[0] / (rc.group->size() / pp);
      CHORUS_CHECK(!std::isnan(last_loss), "the loss is NaN between steps ", window.first + 1, " and ", step + 1,
                   " (lower --lr)");
      stop = summed[1] > 0;
      if (summed[2] > 0) {  // rank 0 decided, every rank joins the report's all-reduce
        const std::string line = rank_times.report(rc, step + 1, ddp ? ddp->gradient_wait_seconds() : 0.0);
        last_report = Clock::now();
        if (!line.empty() && !tc.quiet) std::fprintf(stderr, "%s\n", line.c_str());
      }
      const double secs = seconds_since(window.start);
      tok_s = static_cast<double>(n * tokens_per_step) / std::max(secs, 1e-9);
      if (val && g.val_every && (step + 1) % g.val_every == 0) last_val = val_loss();
      if (leader && !tc.quiet) {
        std::fprintf(stderr, "step %lld/%lld | loss %.4f | ppl %.2f | lr %.2e | norm %.3f | %s tok/s%s\n",
                     (long long)(step + 1), (long long)total_steps, last_loss, std::exp(last_loss), opt.lr(), norm.item(),
                     fmt_count(tok_s).c_str(),
                     std::isnan(last_val) ? "" : (" | val " + std::to_string(last_val)).c_str());
      }
      window.restart(step + 1);
    }
    if (end_gpt_step(tc, step, last, stop, leader, save)) break;
  }
  tracer.finish();
  save(step);
  throw_if_stopped(step, total_steps, leader, ckpt);
  if (val) last_val = val_loss();
  nlohmann::ordered_json out = {{"model", tc.model},
                                {"strategy", "mesh"},
                                {"mesh", dist::mesh_spec_str(axes)},
                                {"sequence_parallel", g.sequence_parallel},
                                {"tp_chunks", g.tp_chunks},
                                {"micro_batches", pp > 1 ? nlohmann::ordered_json(ps.micro_batches) : nlohmann::ordered_json(nullptr)},
                                {"schedule", pp > 1 ? nlohmann::ordered_json(ps.schedule) : nlohmann::ordered_json(nullptr)},
                                {"virtual_stages",
                                 pp > 1 ? nlohmann::ordered_json(ps.virtual_stages) : nlohmann::ordered_json(nullptr)},
                                {"devices", std::to_string(rc.group->size()) + " ranks"},
                                {"precision", tc.precision},
                                {"params", cfg.num_parameters()},
                                {"seq_len", seq},
                                {"batch_per_device", batch},
                                {"grad_accum", accum},
                                {"steps", step},
                                {"tokens", step * tokens_per_step},
                                {"train_loss", last_loss},
                                {"val_loss", std::isnan(last_val) ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(last_val)},
                                {"tok_per_s", tok_s},
                                {"peak_mem_bytes", static_cast<double>(backend(device).peak_bytes(device))},
                                {"seconds", seconds_since(t_start)}};
  if (!ckpt.empty()) out["checkpoint"] = ckpt;
  if (leader && !tc.quiet) {
    std::fprintf(stderr, "done: %lld steps, train loss %.4f", (long long)step, last_loss);
    if (!std::isnan(last_val)) std::fprintf(stderr, ", val loss %.4f", last_val);
    std::fprintf(stderr, ", %s tok/s, %.1f s\n", fmt_count(tok_s).c_str(), seconds_since(t_start));
  }
  if (!leader) return nullptr;
  return out;
}

}  // namespace chorus::app
