// `chorus train` for image models, its epoch loop (train_image.h): steps with
// periodic, not per-step, reads of the loss and accuracy, the stats line
// (Note [Slow ranks named]), --trace, checkpoints, the stop on a signal, each
// epoch's evaluation and metrics.
#include "train_image.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>

#include "chorus/autograd/grad_mode.h"
#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/data_parallel/replica_sync.h"
#include "chorus/data/loader.h"
#include "chorus/nn/functional.h"
#include "chorus/ops/elementwise.h"
#include "chorus/ops/reduce.h"
#include "chorus/ops/profile.h"
#include "memory_check.h"
#include "progress.h"
#include "run_position.h"
#include "run_log.h"
#include "step_trace.h"
#include "stop_signal.h"
#include "train_dist.h"
#include "train_step.h"

namespace chorus::app::image_train {

EvalResult evaluate(nn::Module& model, data::DataLoader& loader, bool channels_last,
                    const RankContext* ranks) {
  NoGradGuard ng;
  model.eval();
  loader.start_epoch(0);
  data::Batch b;
  Tensor loss_sum, correct;
  int64_t n = 0;
  while (loader.next(&b)) {
    Tensor logits = model.forward(in_layout(b.images, channels_last));
    Tensor l = ops::unary(UnaryOp::MulScalar, nn::functional::cross_entropy(logits, b.labels), b.labels.size(0));
    Tensor c = ops::reduce(ReduceOp::Sum, ops::binary(BinaryOp::Eq, ops::reduce(ReduceOp::Argmax, logits, {1}, false), b.labels), {}, false);
    loss_sum = loss_sum.defined() ? ops::binary(BinaryOp::Add, loss_sum, l) : l;
    correct = correct.defined() ? ops::binary(BinaryOp::Add, correct, c) : c;
    n += b.labels.size(0);
  }
  model.train();
  std::vector<double> sums = {loss_sum.defined() ? loss_sum.item() : 0.0, correct.defined() ? correct.item() : 0.0,
                              static_cast<double>(n)};
  if (ranks) sums = sum_over_ranks(*ranks, sums);
  if (sums[2] == 0) return {};
  return {sums[0] / sums[2], sums[1] / sums[2]};
}

// Before evaluating through the model itself (a collective under ddp and
// zero): rank 0's batch-norm statistics everywhere, as its checkpoint has
// them; under zero the full weights in the module too.
void ready_to_evaluate(Training& t) {
  if (t.ddp) t.ddp->broadcast_buffers();
  if (!t.sdp) return;
  t.sdp->gather_parameters();
  NoGradGuard ng;
  std::vector<Tensor> buffers;
  for (auto& [name, b] : t.model->named_buffers()) buffers.push_back(b);
  dist::broadcast_in_place(*t.ranks->group, buffers);
}

namespace {

// Training loss and accuracy over a window of steps. They stay on the device;
// the host reads them only when the window closes (every --log-every steps),
// so no step waits for the GPU.
class StepStats {
 public:
  void add(const TrainStep::Result& r, const Tensor& labels) {
    NoGradGuard ng;
    Tensor l = ops::unary(UnaryOp::MulScalar, r.loss.detach(), labels.size(0));
    Tensor c = ops::reduce(ReduceOp::Sum,
                           ops::binary(BinaryOp::Eq, ops::reduce(ReduceOp::Argmax, r.logits.detach(), {1}, false), labels),
                           {}, false);
    loss_ = loss_.defined() ? ops::binary(BinaryOp::Add, loss_, l) : l;
    correct_ = correct_.defined() ? ops::binary(BinaryOp::Add, correct_, c) : c;
    count_ += labels.size(0);
    ++steps_;
  }
  // Time inside the window that was not training (an epoch's evaluation and
  // checkpoint): left out of its img/s and step time.
  void exclude(double seconds) { excluded_s_ += seconds; }
  struct Window {
    double loss, accuracy, img_per_s, step_ms;
    bool report = false;  // rank 0 asked for the ranks' step times (Note [Slow ranks named])
  };
  // Rank 0: ask every rank, through this window's all-reduce, for a RankTimes report.
  void ask_for_report() { report_due_ = true; }
  // Reads the window (one host wait) and starts the next one. Under DDP the
  // figures are over all ranks (Note [Training ranks]).
  Window close(const RankContext* ranks = nullptr) {
    auto now = std::chrono::steady_clock::now();
    const double secs = std::chrono::duration<double>(now - start_).count() - excluded_s_;
    std::vector<double> sums = {loss_.item(), correct_.item(), static_cast<double>(count_), report_due_ ? 1.0 : 0.0};
    if (ranks) sums = sum_over_ranks(*ranks, sums);
    Window w{sums[0] / sums[2], sums[1] / sums[2], secs > 0 ? sums[2] / secs : 0,
             steps_ > 0 ? 1000.0 * secs / static_cast<double>(steps_) : 0, sums[3] > 0};
    *this = StepStats();
    start_ = now;
    return w;
  }

 private:
  Tensor loss_, correct_;
  int64_t count_ = 0, steps_ = 0;
  double excluded_s_ = 0;
  bool report_due_ = false;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

// End of an epoch: checkpoint, then test-set evaluation when anyone reads it.
void finish_epoch(const TrainConfig& cfg, Training& t, const Position& pos, RunLog* log, Progress& progress) {
  save(cfg, t, pos);
  if (!t.evaluate_epochs) return;
  ready_to_evaluate(t);
  EvalResult ev = evaluate(*t.model, *t.test_loader, t.channels_last, t.rank_context());
  progress.finish();
  if (!cfg.quiet)
    std::fprintf(stderr, "epoch %lld/%lld: test loss %.4f, test accuracy %.4f\n", (long long)pos.epoch,
                 (long long)cfg.epochs, ev.loss, ev.accuracy);
  // Memory at the epoch's end and its peak during the epoch (the largest over
  // this process's devices): a steady run shows the same peak epoch after epoch.
  size_t in_use = 0, peak = 0;
  nlohmann::ordered_json per_device = nlohmann::ordered_json::object();
  for (const Device& d : t.devices) {
    in_use = std::max(in_use, backend(d).bytes_in_use(d));
    peak = std::max(peak, backend(d).peak_bytes(d));
    per_device[d.str()] = backend(d).peak_bytes(d);
    backend(d).reset_peak_bytes(d);
  }
  if (log)
    log->epoch({{"step", pos.step}, {"epoch", pos.epoch}, {"test_loss", ev.loss}, {"test_accuracy", ev.accuracy},
                {"mem_in_use_bytes", in_use}, {"peak_mem_bytes", peak}, {"peak_mem_bytes_per_device", per_device}});
}

// Whether to stop after this step: at once on a signal for one process; under
// DDP after the step the ranks agreed on (Note [Stopping ranks together]).
bool should_stop(const Training& t, StopAgreement* agreement, int64_t step) {
  return agreement ? agreement->stop_after(step, StopSignal::pending() != 0) : StopSignal::pending() != 0;
}

// The L2 norm of the model's gradients after the last step (what its update
// used: averaged over the ranks under DDP, summed over the replicas under
// DataParallel); unset when no parameter has one. Read at log windows only:
// one host wait.
std::optional<double> grad_norm(const Training& t) {
  NoGradGuard ng;
  Tensor sum;
  for (const Tensor& p : t.model->parameters()) {
    if (!p.grad().defined()) continue;
    Tensor g = p.grad();
    Tensor s = ops::reduce(ReduceOp::Sum, ops::binary(BinaryOp::Mul, g, g), {}, false);
    if (s.dtype() != kFloat32) s = s.to(kFloat32);
    sum = sum.defined() ? ops::binary(BinaryOp::Add, sum, s) : s;  // cross-device operands move to `sum`'s device
  }
  if (!sum.defined()) return std::nullopt;
  return std::sqrt(sum.item());
}

// The largest peak of this process's devices since the epoch began.
size_t peak_bytes(const std::vector<Device>& devices) {
  size_t peak = 0;
  for (const Device& d : devices) peak = std::max(peak, backend(d).peak_bytes(d));
  return peak;
}

}  // namespace

LoopResult train_loop(const TrainConfig& cfg, Training& t, Position& pos, RunLog* log, StepTracer& tracer) {
  LoopResult out;
  Progress progress(!cfg.quiet);
  StepStats stats;
  RankTimes rank_times;  // Note [Slow ranks named]
  auto last_report = std::chrono::steady_clock::now();
  std::optional<StopAgreement> agreement;
  if (t.ranks) agreement.emplace(*t.ranks);
  const int64_t start_epoch = pos.epoch;
  const int64_t first_step = pos.step;
  t.model->train();
  for (int64_t epoch = start_epoch; epoch < cfg.epochs && pos.step < t.total_steps; ++epoch) {
    pos.epoch = epoch;
    if (epoch != start_epoch) pos.batch_in_epoch = 0;
    t.train_loader->start_epoch(epoch, pos.batch_in_epoch);
    data::Batch b;
    while (pos.step < t.total_steps) {
      tracer.begin_step(pos.step + 1);  // --trace: the chosen steps, their data loading included
      const auto step_begin = std::chrono::steady_clock::now();
      bool got = false;
      {
        ops::TraceScope data("data");
        got = t.train_loader->next(&b);
      }
      const auto data_end = std::chrono::steady_clock::now();
      if (!got) break;
      // Note [Progress in samples]: the schedule at the examples consumed.
      t.opt->set_lr(lr_at_position([&](int64_t k) { return t.schedule->lr_at(k); }, pos.samples, t.step_samples));
      // Labels go where the loss is computed (the output device); the images
      // stay where the loader put them (host memory under DataParallel).
      if (b.labels.device() != t.devices[0]) b.labels = b.labels.to(t.devices[0]);
      stats.add(t.step.run(in_layout(b.images, t.channels_last), b.labels), b.labels);
      ++pos.step;
      ++pos.batch_in_epoch;
      pos.samples += t.global_batch;  // a last, partial batch of an epoch counts whole, on every rank alike
      out.images += b.labels.size(0);
      tracer.end_step(pos.step);
      // Note [Measured beside the plan] (apps/memory_check.h).
      if (t.memory_plan && (pos.step == first_step + 2 || (pos.step == first_step + 1 && pos.step == t.total_steps))) {
        progress.finish();
        std::fprintf(stderr, "%s\n", dist::measured_line(*t.memory_plan, static_cast<int64_t>(peak_bytes(t.devices))).c_str());
      }
      if (t.ranks) {
        const auto now = std::chrono::steady_clock::now();
        rank_times.add_step(std::chrono::duration<double>(now - step_begin).count(),
                            std::chrono::duration<double>(data_end - step_begin).count());
      }
      if (pos.step % cfg.log_every == 0 || pos.step == t.total_steps) {
        const auto now = std::chrono::steady_clock::now();
        if (t.ranks) rank_times.arrive();  // Note [Late arrivals]
        if (t.ranks && t.ranks->leader() && cfg.stats_every_s > 0 &&
            std::chrono::duration<double>(now - last_report).count() >= cfg.stats_every_s)
          stats.ask_for_report();
        StepStats::Window w = stats.close(t.rank_context());
        if (w.report) {  // every rank, at the same step
          const std::string line = rank_times.report(*t.ranks, pos.step, t.ddp ? t.ddp->gradient_wait_seconds() : 0.0);
          last_report = now;
          if (!line.empty() && !cfg.quiet) {
            progress.finish();
            std::fprintf(stderr, "%s\n", line.c_str());
          }
        }
        out.last_loss = w.loss;
        out.last_acc = w.accuracy;
        CHORUS_CHECK_T(Error, std::isfinite(w.loss), "training diverged: the loss is ", w.loss, " at step ", pos.step,
                       " (try a smaller --lr)");
        progress.update({pos.step, t.total_steps, epoch + 1, cfg.epochs, w.loss, w.accuracy, w.img_per_s});
        if (log) {
          nlohmann::ordered_json rec = {{"step", pos.step}, {"samples", pos.samples}, {"epoch", epoch + 1}, {"loss", w.loss},
                                        {"accuracy", w.accuracy}, {"lr", t.opt->lr()}, {"img_per_s", w.img_per_s},
                                        {"step_ms", w.step_ms}, {"world_size", t.world()}};
          if (auto norm = grad_norm(t)) rec["grad_norm"] = *norm;
          rec["peak_mem_bytes"] = peak_bytes(t.devices);
          log->step(rec);
        }
      }
      // The epoch's last step is saved by finish_epoch, as the next epoch's start.
      if (cfg.checkpoint_every > 0 && pos.step % cfg.checkpoint_every == 0 && pos.batch_in_epoch < t.per_epoch)
        save(cfg, t, pos);
      if (should_stop(t, agreement ? &*agreement : nullptr, pos.step)) stop_for_signal(cfg, t, pos, progress);
    }
    if (pos.batch_in_epoch >= t.per_epoch) {
      const auto eval_start = std::chrono::steady_clock::now();
      finish_epoch(cfg, t, {pos.step, epoch + 1, 0, pos.samples}, log, progress);
      stats.exclude(std::chrono::duration<double>(std::chrono::steady_clock::now() - eval_start).count());
    } else {
      save(cfg, t, pos);  // stopped inside the epoch (--steps): resumable from here
    }
  }
  progress.finish();
  return out;
}

}  // namespace chorus::app::image_train
