// `chorus bench --model gpt2|...|dN --mesh dp=A,pp=B,tp=C`: a tensor-parallel
// GPT's training throughput on random token ids, every rank of the mesh
// running the step `chorus train --mesh` runs (forward, vocabulary-parallel
// loss, backward, DDP over the dp groups or the pipeline's averaging,
// global-norm clipping, AdamW), timed after a warm-up. Rank 0 prints one row
// (with pp > 1 one per schedule of --schedules, --micro-batches each; naive:
// one micro-batch): tokens/s of the whole job, per GPU, MFU (llm.c's FLOP
// count over all the GPUs' peak) and peak memory.
//
// Note [Mesh pipeline bound]: a pipeline row also gives its bubble, measured
// as bench_pipeline.cpp measures it (each rank's busy time in its tasks on a
// few more steps with every task timed on the device alone, against the timed
// step: 1 - mean busy / step), beside the schedule's ideal bubble
// (p-1)/(v m + p-1) (plan::pipeline_bubble; v = 1 for 1F1B and GPipe, the
// virtual stages per rank for interleaved), and a bound: the tokens/s of a
// step whose slowest stage works its measured busy time at the micro-batch's
// own size and idles only the ideal bubble, tokens * (1 - ideal) / max busy.
// It is bench_pipeline.cpp's --bound (D devices at the micro-batch's speed
// times 1 - ideal) with the micro-batch's speed measured in place, per stage,
// its tensor-parallel communication included.
//
// --trace FILE: the last row's --trace-steps timed steps, every rank's spans
// in one file, as `chorus train --mesh --trace` writes them (Note [Traces of
// several ranks] in step_trace.h): the phases are the trainer's (forward,
// backward, optimizer; with pp > 1 pipeline, reduce_gradients, optimizer),
// each group's collectives on a track of its own ("gloo tp collectives").
// The bubble's measured steps come after the timed ones and are not traced.
#include <algorithm>
#include <chrono>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "bench.h"
#include "chorus/autograd/autocast.h"
#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/core/rng.h"
#include "chorus/data_parallel/ddp.h"
#include "chorus/ops/factory.h"
#include "chorus/ops/profile.h"
#include "chorus/optim/adamw.h"
#include "chorus/plan/cost_model.h"
#include "chorus/tensor_parallel/clip_grad.h"
#include "gpt_mesh.h"
#include "step_trace.h"
#include "train_dist.h"
#include "train_gpt.h"
#include "train_pipeline.h"

namespace chorus::app {

namespace {

// One timed configuration's figures.
struct MeshRow {
  double dt = 0;  // seconds of c.steps steps
  double loss = 0;
  std::vector<double> peaks;  // per world rank
  double bubble = -1, bubble_ideal = 0, bound_tok_s = 0;
  std::vector<double> stage_busy_ms;  // per pipeline rank (its stages together), mean over its ranks
  std::vector<int64_t> balance;       // layers per stage (Note [Pipeline stages by cost] without --balance)
};

}  // namespace

int run_bench_gpt_mesh(const BenchConfig& c) {
  CHORUS_CHECK(c.strategy == "single", "chorus bench --mesh sets the layout itself: --strategy ", c.strategy,
               " cannot go with it");
  CHORUS_CHECK(c.precision == "fp32" || c.precision == "bf16", "unknown precision '", c.precision, "'");
  CHORUS_CHECK(c.recompute == "never", "chorus bench --mesh: --recompute is not offered with --mesh yet");
  CHORUS_CHECK(!c.recompute_gelu, "chorus bench --mesh: --recompute-gelu is not offered with --mesh yet");
  CHORUS_CHECK(c.batch_size > 0 && c.steps > 0 && c.warmup >= 0, "--batch-size and --steps must be positive");
  if (c.trace) {
    const auto [first, last] = parse_trace_steps(c.trace_steps);
    CHORUS_CHECK(last <= c.steps, "--trace-steps ", c.trace_steps, " goes past the ", c.steps,
                 " timed steps (--steps): --trace records timed steps only");
    (void)first;
  }
  const int64_t seq = c.seq_len > 0 ? c.seq_len : 1024;
  models::GPTConfig cfg = models::GPTConfig::named(c.model, 50257, std::max<int64_t>(seq, 1024));
  cfg.attention = ops::parse_attention_kernel(c.attention);
  MeshSettings ms;
  ms.spec = *c.mesh;
  ms.sequence_parallel = c.sequence_parallel;
  ms.tp_chunks = c.tp_chunks;
  ms.devices = c.devices;
  ms.quiet = c.json;
  const auto axes = check_mesh_gpt(ms, cfg, seq);
  const int pp = mesh_axis_size(axes, "pp");
  // Every row's settings checked before any group exists (each rank says the same line).
  std::vector<std::pair<std::string, MeshPipeSettings>> rows;
  if (pp > 1) {
    const std::vector<std::string> names = split_list(c.schedules);
    CHORUS_CHECK(!names.empty(), "--schedules is empty (expected e.g. gpipe,1f1b)");
    CHORUS_CHECK(c.virtual_stages == 0 || std::find(names.begin(), names.end(), "interleaved") != names.end(),
                 "--virtual-stages goes with the interleaved schedule (--schedules ", c.schedules, " has none)");
    for (const std::string& name : names) {
      MeshPipeSettings ps;
      ps.micro_batches = name == "naive" ? 1 : c.micro_batches;  // naive: one micro-batch, one stage at a time
      ps.schedule = name == "naive" ? "gpipe" : name;
      if (name == "interleaved") ps.virtual_stages = c.virtual_stages > 0 ? c.virtual_stages : 2;
      if (c.balance) ps.balance = parse_balance(*c.balance);
      if (name == "naive") {
        // One micro-batch: only the balance has something to check (pp micro-batches of one sample pass the rest).
        check_mesh_pipeline(axes, cfg, MeshPipeSettings{pp, "gpipe", 1, ps.balance}, pp);
      } else {
        check_mesh_pipeline(axes, cfg, ps, c.batch_size);
      }
      rows.emplace_back(name, ps);
    }
  } else {
    CHORUS_CHECK(!c.balance, "--balance goes with pipeline stages: --mesh pp=N with N > 1");
    rows.emplace_back("", MeshPipeSettings{});
  }
  MeshGpt m = start_mesh_gpt(ms, cfg, seq);
  const Device dev = m.device;
  CHORUS_CHECK(c.precision == "fp32" || dev.is_cuda(), "--precision bf16 needs a CUDA device (got ", dev.str(), ")");
  const int world = m.rc.group->size();
  // Each data rank its own ids, the same on its tensor ranks and stages.
  manual_seed(1000 + static_cast<uint64_t>(m.dp_rank()));
  Tensor ids = randint(0, cfg.vocab, {c.batch_size, seq}, {kInt64, dev});
  Tensor tg = randint(0, cfg.vocab, {c.batch_size, seq}, {kInt64, dev});
  const std::optional<DType> cast = c.precision == "bf16" ? std::optional<DType>(kBFloat16) : std::nullopt;
  const double peak_flops = dev.is_cuda() ? bf16_peak_flops(backend(dev).device_name(dev)) : 0.0;
  const double tokens = static_cast<double>(c.batch_size * seq * m.dp());

  auto run_row = [&](const MeshPipeSettings& ps, bool traced) {
    std::optional<MeshPipeline> mp;
    if (pp > 1) mp.emplace(start_mesh_pipeline(m, ps, seq));  // moves this rank's stage before the optimizer sees it
    std::shared_ptr<dist::DistributedDataParallel> ddp;
    nn::ModulePtr net = m.model;
    if (m.dp() > 1 && !mp) net = ddp = std::make_shared<dist::DistributedDataParallel>(m.model, m.mesh->group("dp"));
    const auto sharded = tp::sharded_parameters(*m.model);
    optim::AdamWOptions ao{6e-4, 0.9, 0.95, 1e-8, 0.1};
    std::vector<Tensor> params;
    for (const auto& p : sharded) {
      params.push_back(p.tensor);
      const bool embedding = p.name.find(".wte.") != std::string::npos || p.name.find(".wpe.") != std::string::npos;
      ao.param_weight_decay.push_back(p.tensor.dim() >= 2 && !embedding ? 0.1 : 0.0);
    }
    optim::AdamW opt(params, ao);
    Tensor loss;
    // The phases chorus train --mesh traces (each scope one atomic load when no trace is on).
    auto step = [&] {
      if (mp) {
        {
          ops::TraceScope pipe("pipeline");
          AutocastGuard g(cast);
          loss = mp->pipe->train_step(ids, tg, [&](const Tensor& out, const Tensor& t) {
                        return m.model->loss_of_logits(out, t);
                      }).loss;
        }
        ops::TraceScope reduce("reduce_gradients");
        reduce_pipeline_gradients(m, *mp);
      } else {
        {
          ops::TraceScope forward("forward");
          AutocastGuard g(cast);
          loss = m.model->loss_of_logits(net->forward(ids), tg);
        }
        ops::TraceScope backward("backward");
        loss.backward();
      }
      ops::TraceScope optimizer("optimizer");
      clip_mesh_gradients(m, mp ? &*mp : nullptr, sharded, 1.0);
      opt.step();
      opt.zero_grad();
    };
    for (int64_t i = 0; i < c.warmup; ++i) step();
    synchronize(dev);
    m.rc.group->barrier()->wait();
    backend(dev).reset_peak_bytes(dev);
    // Every rank traces (rank 0 gathers the others' spans through the store and writes the file).
    StepTracer tracer(traced ? c.trace : std::nullopt, c.trace_steps, m.rc.group->store(), m.rc.env.rank, world, !c.json);
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < c.steps; ++i) {
      tracer.begin_step(i + 1);
      step();
      tracer.end_step(i + 1);
    }
    synchronize(dev);
    m.rc.group->barrier()->wait();
    MeshRow r;
    r.dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // Collectives every rank joins: the loss (held by the last stage), each rank's peak.
    std::vector<double> mine(static_cast<size_t>(world + 1), 0.0);
    if (loss.defined()) mine[0] = loss.item();
    mine[static_cast<size_t>(1 + m.rc.group->rank())] = static_cast<double>(backend(dev).peak_bytes(dev));
    const std::vector<double> all = sum_over_ranks(m.rc, mine);
    r.loss = all[0] / static_cast<double>(world / pp);
    r.peaks.assign(all.begin() + 1, all.end());
    if (mp) {
      // Note [Mesh pipeline bound]
      const int measured = 3;
      mp->pipe->set_measure(true);
      double busy = 0;
      for (int i = 0; i < measured; ++i) {
        step();
        busy += mp->pipe->last_stats().busy_ms.at(0) / measured;
      }
      mp->pipe->set_measure(false);
      std::vector<double> per_stage(static_cast<size_t>(pp), 0.0);
      per_stage[static_cast<size_t>(m.pp_rank())] = busy;
      per_stage = sum_over_ranks(m.rc, per_stage);
      double mean = 0, most = 0;
      for (double& b : per_stage) {
        b /= static_cast<double>(world / pp);
        mean += b / pp;
        most = std::max(most, b);
      }
      const double step_ms = 1000.0 * r.dt / static_cast<double>(c.steps);
      const int64_t M = ps.micro_batches;
      r.stage_busy_ms = per_stage;
      r.balance = mp->pipe->balance();
      r.bubble = std::max(0.0, 1.0 - mean / step_ms);
      r.bubble_ideal = plan::pipeline_bubble(pp, M, ps.virtual_stages);
      r.bound_tok_s = most > 0 ? tokens * (1.0 - r.bubble_ideal) / (most / 1000.0) : 0.0;
    }
    return r;
  };

  for (const auto& [name, ps] : rows) {
    const MeshRow r = run_row(ps, &ps == &rows.back().second);  // --trace: the last row
    if (!m.rc.leader()) continue;
    const double tok_s = tokens * static_cast<double>(c.steps) / r.dt;
    const double mfu = peak_flops > 0 ? tok_s * cfg.flops_per_token(seq) / (peak_flops * world) : 0.0;
    const double peak_max = *std::max_element(r.peaks.begin(), r.peaks.end());
    nlohmann::ordered_json row = {{"model", c.model},
                                  {"strategy", "mesh"},
                                  {"mesh", dist::mesh_spec_str(m.mesh->axes())},
                                  {"sequence_parallel", c.sequence_parallel},
                                  {"tp_chunks", c.tp_chunks},
                                  {"devices", std::to_string(world) + " ranks"},
                                  {"device_name", backend(dev).device_name(dev)},
                                  {"precision", c.precision},
                                  {"batch_per_device", c.batch_size},
                                  {"seq_len", seq},
                                  {"params", cfg.num_parameters()},
                                  {"tok_per_s", tok_s},
                                  {"tok_per_s_per_device", tok_s / world},
                                  {"step_ms", 1000.0 * r.dt / static_cast<double>(c.steps)},
                                  {"mfu", peak_flops > 0 ? nlohmann::ordered_json(mfu) : nlohmann::ordered_json(nullptr)},
                                  {"peak_mem_bytes", r.peaks[0]},
                                  {"peak_mem_bytes_max", peak_max},
                                  {"loss", r.loss},
                                  {"cuda_graph", false}};
    add_provenance(row, dev);  // device_name and commit, as every bench row
    if (pp > 1) {
      row["schedule"] = name;
      row["micro_batches"] = ps.micro_batches;
      row["virtual_stages"] = ps.virtual_stages;
      row["balance"] = r.balance;
      row["bubble"] = r.bubble;
      row["bubble_ideal"] = r.bubble_ideal;
      row["stage_busy_ms"] = r.stage_busy_ms;
      row["bound_tok_per_s"] = r.bound_tok_s;
      row["of_bound"] = r.bound_tok_s > 0 ? tok_s / r.bound_tok_s : 0.0;
    }
    if (c.json) {
      std::printf("%s\n", row.dump().c_str());
      continue;
    }
    std::printf("%-10s mesh %-14s %-5s batch %lld x %lld  %10.0f tok/s (%8.0f per device)  %8.2f ms/step",
                c.model.c_str(), dist::mesh_spec_str(m.mesh->axes()).c_str(), c.precision.c_str(),
                (long long)c.batch_size, (long long)seq, tok_s, tok_s / world, 1000.0 * r.dt / static_cast<double>(c.steps));
    if (peak_flops > 0) std::printf("  MFU %5.1f%%", 100 * mfu);
    std::printf("  peak %8.1f MiB (rank 0), %8.1f MiB (most)\n", r.peaks[0] / (1 << 20), peak_max / (1 << 20));
    if (pp > 1)
      std::printf("%-10s   pipeline %-5s M=%-3lld V=%lld bubble %.3f (ideal %.3f)  bound %10.0f tok/s (%.2f of it)\n",
                  c.model.c_str(), name.c_str(), (long long)ps.micro_batches, (long long)ps.virtual_stages, r.bubble,
                  r.bubble_ideal, r.bound_tok_s, r.bound_tok_s > 0 ? tok_s / r.bound_tok_s : 0.0);
  }
  return 0;
}

}  // namespace chorus::app
