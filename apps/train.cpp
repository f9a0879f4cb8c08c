// The training driver for image models, in the order run_train calls it:
// set_up (data, model, optimizer, schedule from the config:
// apps/train_setup.cpp), resume (from the newest checkpoint:
// apps/train_resume.cpp), train_loop (epochs of TrainStep with periodic, not
// per-step, reads of the loss; evaluation; checkpoints that make a killed run
// resumable to the same weights; metrics: apps/train_loop.cpp) and summarize
// (the closing summary, here). GPT models have their own driver
// (apps/train_gpt.h); the options' checks are in apps/train_config.cpp.
#include "train.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>

#include "chorus/core/backend.h"
#include "chorus/io/dir_lock.h"
#include "run_log.h"
#include "step_trace.h"
#include "stop_signal.h"
#include "train_image.h"

namespace chorus::app {

namespace fs = std::filesystem;
using namespace image_train;

namespace {

nlohmann::ordered_json summarize(const TrainConfig& cfg, Training& t, const Position& start, const Position& end,
                                 const LoopResult& loop, double seconds) {
  ready_to_evaluate(t);
  EvalResult final_eval = evaluate(*t.model, *t.test_loader, t.channels_last, t.rank_context());
  std::vector<std::string> device_names;
  for (const Device& d : t.devices) device_names.push_back(d.str());
  const int64_t steps_run = std::max<int64_t>(end.step - start.epoch * t.per_epoch - start.batch_in_epoch, 1);
  using J = nlohmann::ordered_json;
  return {{"model", cfg.model},
          {"data", cfg.data},
          {"strategy", cfg.strategy},
          {"devices", device_names},
          {"world_size", t.world()},
          {"precision", cfg.precision},
          {"channels_last", t.channels_last},
          {"epochs", cfg.epochs},
          {"steps", end.step},
          {"samples", end.samples},
          {"batch_size", cfg.batch_size},
          {"train_loss", std::isnan(loop.last_loss) ? J(nullptr) : J(loop.last_loss)},
          {"train_accuracy", loop.last_acc},
          {"test_loss", final_eval.loss},
          {"test_accuracy", final_eval.accuracy},
          {"img_per_s", seconds > 0 ? static_cast<double>(loop.images * t.world()) / seconds : 0.0},
          {"seconds", seconds},
          {"seconds_per_epoch", seconds * static_cast<double>(t.per_epoch) / static_cast<double>(steps_run)},
          // Note [Graphed step]: steps replayed from the captured graph (null: graphs off or not applicable).
          {"cuda_graph_replays", t.step.graph ? J(t.step.graph->replays()) : J(nullptr)}};
}

}  // namespace

nlohmann::ordered_json run_train(const TrainConfig& given) {
  given.validate();
  StopSignal stop_signal;
  Training t = set_up(given);
  // Note [Training ranks]: only rank 0 speaks and writes metrics.
  TrainConfig cfg = given;
  t.evaluate_epochs = given.metrics || given.tensorboard || given.plot || !given.quiet;
  const bool leader = !t.ranks || t.ranks->leader();
  if (!leader) {
    cfg.quiet = true;
    cfg.metrics.reset();
    if (!cfg.tensorboard_all_ranks) cfg.tensorboard.reset();
    cfg.plot.reset();
  }
  // Note [Checkpoint directory lock]: the writer holds its directory until it ends.
  std::optional<io::CheckpointDirLock> dir_lock;
  if (leader && cfg.checkpoint_dir) dir_lock.emplace(*cfg.checkpoint_dir);
  const Position start = plan_run(cfg, t, resume(cfg, t));
  RunLogOptions lo;
  lo.metrics = cfg.metrics;
  lo.append = cfg.resume;
  lo.tensorboard = tensorboard_run_dir(cfg.tensorboard, cfg.model, cfg.strategy, t.ranks ? &*t.ranks : nullptr,
                                      cfg.tensorboard_all_ranks);
  lo.plot = cfg.plot;
  lo.run_name = cfg.metrics ? fs::path(*cfg.metrics).stem().string() : cfg.model + " " + cfg.strategy;
  RunLog log(lo);
  announce(cfg, t);
  plan_memory(cfg, t);
  if (log.tensorboard() && !cfg.quiet) std::fprintf(stderr, "tensorboard: %s\n", log.tensorboard()->path().c_str());
  const auto t0 = std::chrono::steady_clock::now();
  Position pos = start;
  // Note [Traces of several ranks]: every rank records; rank 0 writes the file.
  StepTracer tracer(cfg.trace, cfg.trace_steps, t.ranks ? t.ranks->group->store() : nullptr,
                    t.ranks ? t.ranks->env.rank : 0, t.world(), !cfg.quiet);
  LoopResult loop = train_loop(cfg, t, pos, log.any() ? &log : nullptr, tracer);
  tracer.finish();
  if (t.sharded_ckpt) t.sharded_ckpt->wait();  // the last checkpoint is whole on disk before the run reports
  synchronize();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  nlohmann::ordered_json summary = summarize(cfg, t, start, pos, loop, seconds);
  log.summary(summary);
  return leader ? summary : nlohmann::ordered_json();
}

}  // namespace chorus::app
