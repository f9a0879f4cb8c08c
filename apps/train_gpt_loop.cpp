// The GPT step loop (train_gpt_loop.h): the whole step as one CUDA graph
// (eager under --skip-nan), one host read of the loss per log window with
// the progress line, --metrics, --stats-every's line (Note [Late arrivals]
// in apps/train_dist.h) and --trace (Note [Traces of several ranks]),
// validation, checkpoints (sharded under --strategy zero), the stop on a
// signal, --save-hf, and the closing summary.
#include "train_gpt_loop.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>

#include "chorus/autograd/autocast.h"
#include "chorus/autograd/grad_mode.h"
#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/core/rng.h"
#include "chorus/data_parallel/ddp.h"
#include "chorus/io/checkpoint.h"
#include "chorus/io/safetensors.h"
#include "chorus/ops/profile.h"
#include "chorus/optim/clip_grad.h"
#include "chorus/parallel/graphed_step.h"
#include "chorus/parallel/pipeline.h"
#include "gpt_loop_window.h"
#include "memory_check.h"
#include "progress.h"
#include "run_log.h"
#include "run_position.h"
#include "sharded_checkpoints.h"
#include "step_trace.h"
#include "stop_signal.h"
#include "train_zero.h"

namespace chorus::app {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::vector<std::pair<Tensor, Tensor>> pairs_of(const std::vector<Tensor>& in) {
  std::vector<std::pair<Tensor, Tensor>> out;
  for (size_t i = 0; i + 1 < in.size(); i += 2) out.emplace_back(in[i], in[i + 1]);
  return out;
}

}  // namespace

nlohmann::ordered_json run_gpt_loop(const TrainConfig& tc, const GptOptions& g, GptTraining& r, RunLog& log,
                                    Clock::time_point t_start) {
  const Device device = r.devices[0];
  const models::GPTConfig& cfg = r.cfg;
  const std::optional<dist::MemoryPlan>& plan = r.plan;
  const std::vector<Tensor>& params = r.params;
  const int64_t start = r.start, start_tokens = r.start_tokens;
  const int64_t n_params = cfg.num_parameters();
  const double peak = device.is_cuda() ? bf16_peak_flops(backend(device).device_name(device)) : 0.0;
  const double flops_per_step = cfg.flops_per_token(r.seq) * static_cast<double>(r.tokens_per_step());

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
  // Clipping and AdamW; returns the norm before clipping. The scale is read
  // by AdamW's fused update (Note [Clipping in the update] in
  // optim/clip_grad.h): nothing reads the gradients after the step, which
  // zero_grad() drops. Under --strategy zero the global norm is over every
  // rank's pieces, and the scale is folded into the update all the same.
  auto clip_and_step = [&](double max_norm) {
    if (!r.sdp) return optim::clip_and_step(*r.opt, params, max_norm);
    ops::NormAndScale c = r.sdp->clip_grad_norm_scale(max_norm);
    r.opt->step_scaled(c.scale);
    return c.norm;
  };
  parallel::GraphedStepOptions go;
  // Sharded steps too (Note [Sharded steps in a CUDA graph] in data_parallel/sharded.h):
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
        Tensor norm = clip_and_step(g.clip);
        r.opt->zero_grad();
        if (r.tied) r.tied->sync_tied_weights();
        return std::vector<Tensor>{loss, norm};
      },
      go);
  Progress progress(r.leader() && !tc.quiet);
  Tensor last_norm;
  double last_loss = std::nan(""), last_val = std::nan(""), tok_s = 0, mfu = 0;
  int64_t val_step = -1;  // the step last_val was measured at
  LogWindow window(start);
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
  bool set_aside = false;  // the snapshot's memory, once
  auto save = [&](int64_t s) {
    if (!tc.checkpoint_dir) return;
    io::TrainingState st;
    st.step = reference_step(tokens_at(s), r.step_tokens);  // the name, by position
    st.rng = default_generator().state();
    st.config = gpt_config_json(tc, g, r);
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
      last_norm = clip_and_step(g.clip);
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
    window.losses.push_back(step_loss);
    // Note [Measured beside the plan]: the peak of the first two steps
    // beside the plan (the allocator counts on the host as the work is
    // issued: no wait for the device).
    if (plan && r.leader() && (step == start + 1 || (step == start && step + 1 == r.total_steps)))
      std::fprintf(stderr, "%s\n", dist::measured_line(*plan, static_cast<int64_t>(backend(device).peak_bytes(device))).c_str());
    // Note [Device memory breakdown]: once the step is captured (its third
    // call, Note [Graphed step]), before any evaluation; the end of the run
    // prints it again.
    if (r.leader() && !tc.quiet && step == start + 2)
      if (auto line = device_memory_line(device)) std::fprintf(stderr, "%s\n", line->c_str());
    const bool last = step + 1 == r.total_steps;
    const bool read = (step + 1) % tc.log_every == 0 || last;
    bool stop = false;
    if (read) {
      if (r.ranks) rank_times.arrive();  // Note [Late arrivals]: before the wait for the device
      // One host wait per window: every step's loss of the window at once.
      std::vector<double> ls;
      for (const Tensor& l : window.losses) ls.push_back(l.item());
      double sum = 0;
      for (size_t i = 0; i < ls.size(); ++i) {
        CHORUS_CHECK(!std::isnan(ls[i]), "the loss is NaN at step ", window.first + static_cast<int64_t>(i) + 1,
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
      const double secs = seconds_since(window.start);
      const int64_t steps_done = step + 1 - window.first;
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
      window.restart(step + 1);
    }
    // Note [The snapshot's memory set aside] (io/sharded_writer.h): after the
    // step's capture (its third call, Note [Graphed step]) and the measured
    // peak's line, before the first save -- not at the step that saves (that
    // save allocates as it would have).
    const bool saves_now = tc.checkpoint_every > 0 && (step + 1) % tc.checkpoint_every == 0;
    if (sharded_ckpt && !set_aside && step >= start + 2 && !last && !saves_now) {
      set_aside = true;
      const double ms = sharded_ckpt->set_aside();
      if (ms >= 0 && r.leader() && !tc.quiet)
        std::fprintf(stderr, "checkpoints: the snapshot's device memory set aside in the allocator in %.1f ms\n", ms);
    }
    if (end_gpt_step(tc, step, last, stop, r.leader(), save)) break;
  }
  tracer.finish();
  save(step);
  if (sharded_ckpt) {
    // The last checkpoint is whole on disk before the run reports it (or stops).
    sharded_ckpt->wait();
    if (r.leader() && !tc.quiet)
      std::fprintf(stderr, "checkpoint %s: written in %.0f ms\n", ckpt.c_str(), sharded_ckpt->last_write_ms());
    ckpt_stall = sharded_ckpt->writer().totals();
    if (r.leader() && !tc.quiet && ckpt_stall.saves > 0) {
      std::fprintf(stderr, "%s\n", stall_summary(ckpt_stall, fastest_step_ms > 0 ? fastest_step_ms : mean_step_ms()).c_str());
      std::fprintf(stderr, "%s\n", stall_phases_summary(ckpt_stall).c_str());
    }
  }
  throw_if_stopped(step, r.total_steps, r.leader(), ckpt);
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
  // What the driver counts as used on the device at the end (CUDA: total -
  // free from cudaMemGetInfo): the allocator's pools with what they cache,
  // the context, cuBLAS's and cuDNN's workspaces, NCCL's buffers -- the
  // figure llm.c prints as its "device memory usage", where peak_mem_bytes is
  // what tensors held at most.
  if (auto mi = backend(device).memory_info(device))
    out["device_used_bytes"] = static_cast<double>(mi->total - mi->free);
  // Note [Device memory breakdown]: where that memory is.
  if (auto line = add_device_memory(out, device); line && r.leader() && !tc.quiet)
    std::fprintf(stderr, "%s\n", line->c_str());
  if (!ckpt.empty()) out["checkpoint"] = ckpt;
  if (ckpt_stall.saves > 0)
  {
    out["checkpoint_stall_ms"] = (ckpt_stall.stall_ms + ckpt_stall.device_ms) / static_cast<double>(ckpt_stall.saves);
    out["checkpoint_wait_ms"] = ckpt_stall.wait_ms;  // all saves' waits for earlier writes
    // The host stall of the first save and the later ones' mean, and both
    // by phase (Note [Stall by phase] in io/sharded_writer.h).
    out["checkpoint_first_stall_ms"] = ckpt_stall.first_stall_ms;
    if (ckpt_stall.saves > 1)
      out["checkpoint_later_stall_ms"] =
          (ckpt_stall.stall_ms - ckpt_stall.first_stall_ms) / static_cast<double>(ckpt_stall.saves - 1);
    out["checkpoint_stall_phases_ms"] = stall_phases_json(ckpt_stall);
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
