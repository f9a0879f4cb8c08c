// `chorus train` for image models, where a run is (train_image.h): resuming
// from the newest readable checkpoint, the plan of its steps and schedule
// (Note [Progress in samples]), writing checkpoints, and the stop on a signal.
#include "train_image.h"

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <limits>
#include <optional>

#include "chorus/core/error.h"
#include "chorus/core/rng.h"
#include "chorus/io/checkpoint.h"
#include "chorus/io/json_util.h"
#include "chorus/optim/lr_scheduler.h"
#include "progress.h"
#include "resume_checks.h"
#include "run_position.h"
#include "stop_signal.h"
#include "train_dist.h"
#include "sharded_checkpoints.h"

namespace chorus::app::image_train {

namespace {

// A checkpoint's position in this run's terms, once it is known to be
// reachable (Note [Resume checks]). Its batches were of the writer's global
// batch: the position within the epoch is the examples already seen,
// rounded down to this run's batches (Note [Progress in samples]).
Continued continue_from(const TrainConfig& cfg, const Training& t, const io::TrainingState& st,
                        const std::string& state_path) {
  int64_t writer = t.global_batch;
  if (auto it = st.extra.find("global_batch"); it != st.extra.end()) {
    if (!it->is_number_integer() || it->get<int64_t>() <= 0)
      CHORUS_THROW(IOError, state_path, ": \"global_batch\" is ", io::detail::json_excerpt(*it),
                   ", not an integer >= 1");
    writer = it->get<int64_t>();
  }
  const SavedPosition at = read_position(st.extra, kSampleKeys, st.step, writer, state_path);
  check_resume_position(st, at, writer, t.global_batch, t.per_epoch, cfg.epochs, cfg.steps, state_path);
  Continued c;
  c.step_samples = at.per_step;
  c.pos.epoch = st.epoch;
  c.pos.samples = at.consumed;
  int64_t seen = 0;  // examples of the epoch already seen
  if (__builtin_mul_overflow(st.batch_in_epoch, writer, &seen))
    CHORUS_THROW(IOError, state_path, ": batch_in_epoch ", st.batch_in_epoch, " is past the end of an epoch");
  c.pos.batch_in_epoch = std::min(seen / t.global_batch, t.per_epoch);
  c.pos.step = c.pos.epoch * t.per_epoch + c.pos.batch_in_epoch;
  // The schedule the checkpoint was on, as long as the run's length is the same.
  const nlohmann::json now = cfg.to_json();
  auto it = st.extra.find("schedule_steps");
  if (it != st.extra.end() && it->is_number_integer() && it->get<int64_t>() >= 0 && st.config.is_object() &&
      st.config.value("epochs", nlohmann::json()) == now["epochs"] && st.config.value("steps", nlohmann::json()) == now["steps"])
    c.schedule_steps = it->get<int64_t>();
  return c;
}

}  // namespace

// --resume: weights, optimizer, RNG and position from the newest checkpoint
// that can be read (Note [Unreadable checkpoints]), once it is known to
// belong to this run (Note [Resume checks]).
std::optional<Continued> resume(const TrainConfig& cfg, Training& t) {
  if (!cfg.resume) return std::nullopt;
  auto check = [&](const io::TrainingState& st, const std::string& state_path) {
    check_resume_config(st.config, cfg.to_json(), cfg.allow_change, state_path);
    (void)continue_from(cfg, t, st, state_path);
  };
  // Note [Checkpoints at any layout] (apps/sharded_checkpoints.h): either
  // kind, whichever is newest. A zero rank reads its own ranges of it.
  io::Resumed r;
  if (t.sdp) {
    r = resume_at_any_layout(*cfg.checkpoint_dir, *t.model, *t.opt, t.sdp.get(), cfg.start_fresh, check);
  } else {
    if (!t.ranks || t.ranks->leader())
      r = resume_at_any_layout(*cfg.checkpoint_dir, *t.model, *t.opt, nullptr, cfg.start_fresh, check);
    if (t.ranks) {  // Note [Training ranks]: rank 0 picks, every rank loads that one
      const std::string chosen = agree_on_checkpoint(*t.ranks, r.path);
      if (!t.ranks->leader() && !chosen.empty()) {
        r.state = load_at_any_layout(chosen, *t.model, *t.opt, check);
        r.path = chosen;
      }
    }
  }
  // Said even with --quiet: work is being skipped.
  for (const io::SkippedCheckpoint& s : r.skipped)
    std::fprintf(stderr, "chorus: warning: skipped %s: %s; %s\n", s.path.c_str(), s.reason.c_str(),
                 s.kept_as.empty() ? "left in place" : ("kept as " + s.kept_as).c_str());
  if (!r.path) {
    if (!r.skipped.empty())
      std::fprintf(stderr, "chorus: no checkpoint in %s could be read; starting from scratch (--start-fresh)\n",
                   cfg.checkpoint_dir->c_str());
    else if (!cfg.quiet)
      std::fprintf(stderr, "no checkpoint in %s; starting from scratch\n", cfg.checkpoint_dir->c_str());
    return std::nullopt;
  }
  Continued c = continue_from(cfg, t, r.state, state_file_of(*r.path));
  default_generator().set_state(r.state.rng);
  if (!cfg.quiet || !r.skipped.empty())
    std::fprintf(stderr, "resuming from %s (epoch %lld, step %lld, %lld examples seen)\n", r.path->c_str(),
                 (long long)c.pos.epoch + 1, (long long)c.pos.step, (long long)c.pos.samples);
  return c;
}

// Note [Progress in samples]: the budget, the schedule and this run's own
// steps, from the reference step (the checkpoint's when resuming).
Position plan_run(const TrainConfig& cfg, Training& t, const std::optional<Continued>& from) {
  const Position pos = from ? from->pos : Position{};
  if (from) t.step_samples = from->step_samples;
  t.budget = std::numeric_limits<int64_t>::max();
  if (cfg.steps)
    CHORUS_CHECK(!__builtin_mul_overflow(*cfg.steps, t.step_samples, &t.budget), "--steps ", *cfg.steps, " of ",
                 t.step_samples, " examples each is more examples than can be counted");
  // The epochs in reference steps (set_up checked that per_epoch * epochs * global_batch fits).
  const int64_t epoch_steps = t.per_epoch * cfg.epochs * t.global_batch / t.step_samples;
  t.schedule_steps = cfg.steps ? std::min(epoch_steps, *cfg.steps) : epoch_steps;
  if (from && from->schedule_steps) t.schedule_steps = *from->schedule_steps;
  t.schedule = std::make_shared<optim::LinearWarmup>(
      std::min<int64_t>(100, t.schedule_steps / 10),
      std::make_shared<optim::CosineAnnealingLR>(t.lr, std::max<int64_t>(t.schedule_steps, 1)));
  t.total_steps = t.per_epoch * cfg.epochs;
  if (cfg.steps) t.total_steps = std::min(t.total_steps, pos.step + steps_left(pos.samples, t.budget, t.global_batch));
  return pos;
}

std::string save(const TrainConfig& cfg, Training& t, const Position& pos) {
  if (!cfg.checkpoint_dir) return "";
  io::TrainingState st;
  st.epoch = pos.epoch;
  // Named by reference steps (Note [Progress in samples]): pruning and the
  // fallback to an older checkpoint follow the position on any world size.
  st.step = reference_step(pos.samples, t.step_samples);
  st.batch_in_epoch = pos.batch_in_epoch;  // of this run's batches (global_batch)
  st.rng = default_generator().state();
  st.config = cfg.to_json();
  st.extra["global_batch"] = t.global_batch;
  st.extra["world_size"] = t.world();
  st.extra[kSampleKeys.consumed] = pos.samples;
  st.extra[kSampleKeys.per_step] = t.step_samples;
  st.extra["schedule_steps"] = t.schedule_steps;
  // Written already (--checkpoint-every at the step --steps or a signal stops
  // at): once is enough, and a sharded save of one step cannot be committed twice.
  const std::string path = *cfg.checkpoint_dir + "/" + io::checkpoint_name(st.step);
  if (t.saved_samples == pos.samples) return path;
  t.saved_samples = pos.samples;
  if (!t.ranks) return io::save_checkpoint(*cfg.checkpoint_dir, *t.model, *t.opt, st);
  if (t.sharded_ckpt) {
    // Every rank its pieces, written in the background; committed through
    // the job's store (apps/sharded_checkpoints.h).
    const double stall = t.sharded_ckpt->save(st);
    if (t.ranks->leader() && !cfg.quiet)
      std::fprintf(stderr, "checkpoint %s: training stalled %.1f ms (%s)\n", path.c_str(), stall,
                   snapshot_where(t.sharded_ckpt->writer().last_snapshot_devices()).c_str());
    return path;
  }
  // Note [Training ranks]: rank 0 writes; nobody goes on before it is complete.
  const std::string written = t.ranks->leader() ? io::save_checkpoint(*cfg.checkpoint_dir, *t.model, *t.opt, st) : path;
  t.ranks->group->barrier()->wait();
  return written;
}

// Note [Stopping on a signal]: after the step in flight, a checkpoint (when
// there is a directory for it), one line saying so, and Interrupted.
[[noreturn]] void stop_for_signal(const TrainConfig& cfg, Training& t, const Position& pos, Progress& progress) {
  // Under DDP a rank may stop because another one was signalled.
  const int sig = StopSignal::pending() ? StopSignal::pending() : SIGTERM;
  progress.finish();
  const std::string where = save(cfg, t, pos);
  if (t.sharded_ckpt) t.sharded_ckpt->wait();  // whole on disk before the run stops
  if (where.empty())
    std::fprintf(stderr, "chorus: stopped by %s at step %lld; no --checkpoint-dir, so nothing was saved\n",
                 StopSignal::name(sig), (long long)pos.step);
  else
    std::fprintf(stderr, "chorus: stopped by %s at step %lld; checkpoint written to %s (continue with --resume)\n",
                 StopSignal::name(sig), (long long)pos.step, where.c_str());
  throw Interrupted(sig);
}

}  // namespace chorus::app::image_train
