// The parts of `chorus train` for image models (apps/train.cpp runs them in
// order) and what they pass between them: the Training a run is made of
// (train_setup.cpp), its Position and checkpoints (train_resume.cpp), and the
// epoch loop with evaluation (train_loop.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "chorus/core/tensor.h"
#include "chorus/data/dataset.h"
#include "chorus/data/loader.h"
#include "chorus/data/transforms.h"
#include "chorus/data_parallel/ddp.h"
#include "chorus/data_parallel/memory_plan.h"
#include "chorus/data_parallel/sharded.h"
#include "chorus/nn/module.h"
#include "chorus/optim/lr_scheduler.h"
#include "chorus/optim/optimizer.h"
#include "chorus/parallel/pipeline.h"
#include "sharded_checkpoints.h"
#include "train.h"
#include "train_dist.h"
#include "train_step.h"

namespace chorus::app {

class Progress;
class RunLog;
class StepTracer;

namespace image_train {

struct Datasets {
  std::shared_ptr<data::Dataset> train, test;
  std::vector<std::shared_ptr<const data::Transform>> augment;
};

// Everything a run is made of, wired from the config.
struct Training {
  std::vector<Device> devices;
  Datasets data;
  nn::ModulePtr model;                     // what checkpoints and evaluation see
  std::unique_ptr<optim::Optimizer> opt;
  TrainStep step;                          // runs the model or its parallel wrapper
  std::unique_ptr<data::DataLoader> train_loader, test_loader;
  std::shared_ptr<optim::LRSchedule> schedule;  // over reference steps (Note [Progress in samples])
  double lr = 0;                           // the schedule's peak
  int64_t per_epoch = 0;                   // steps of this run's global batch in an epoch
  int64_t total_steps = 0;                 // this run's own steps from 0 to its end (set by plan_run)
  int64_t global_batch = 0;                // examples per step, over all devices and ranks
  int64_t step_samples = 0;                // the run's reference step: its first global batch
  int64_t budget = 0;                      // examples to consume in all: --steps x step_samples (or no limit)
  int64_t schedule_steps = 0;              // the schedule's length in reference steps
  std::optional<RankContext> ranks;        // --strategy ddp or zero
  std::shared_ptr<dist::DistributedDataParallel> ddp;
  // --strategy zero: the optimizer updates this rank's pieces (sdp->shard_parameters());
  // every rank writes its part of each checkpoint (apps/sharded_checkpoints.h).
  std::shared_ptr<dist::ShardedDataParallel> sdp;
  std::unique_ptr<ShardedCheckpointer> sharded_ckpt;
  int64_t saved_samples = -1;              // the position of the last checkpoint this run wrote
  std::shared_ptr<parallel::Pipeline> pipeline;   // --strategy pipeline
  std::string pipeline_line;                     // how the model was split
  bool evaluate_epochs = false;            // the test set after each epoch (decided by rank 0's settings)
  bool channels_last = false;              // NHWC weights and batches (default where every device is a GPU)
  // The memory plan's static part, when printed: the first step's measured
  // peak names the activations (apps/memory_check.h).
  std::optional<dist::MemoryPlan> memory_plan;
  const RankContext* rank_context() const { return ranks ? &*ranks : nullptr; }
  int world() const { return ranks ? ranks->group->size() : 1; }
};

// Where the loop is: a fresh run starts at zero, a resumed one where its
// checkpoint was written. Steps and batches are this run's own (its global
// batch); `samples` is the position of record (Note [Progress in samples]).
struct Position {
  int64_t step = 0, epoch = 0, batch_in_epoch = 0;
  int64_t samples = 0;  // examples consumed, over all devices and ranks
};

// What a resumed run takes from its checkpoint beyond the weights.
struct Continued {
  Position pos;
  int64_t step_samples = 0;                   // the run's reference step
  std::optional<int64_t> schedule_steps;      // the schedule's length, when the run's length is unchanged
};

struct EvalResult {
  double loss = 0, accuracy = 0;
};

struct LoopResult {
  double last_loss = std::nan(""), last_acc = 0;
  int64_t images = 0;
};

// train_setup.cpp: the run wired from the config (data, model, optimizer,
// strategy, loaders); the line announcing it; the memory plan before step 1.
Training set_up(const TrainConfig& cfg);
void announce(const TrainConfig& cfg, const Training& t);
void plan_memory(const TrainConfig& cfg, Training& t);
// --channels-last: a batch of images in the model's layout (converted where
// the loader put it; a DataParallel chunk keeps the layout on its way).
Tensor in_layout(const Tensor& images, bool channels_last);

// train_resume.cpp: resuming, the run's plan, checkpoints, the stop on a signal.
std::optional<Continued> resume(const TrainConfig& cfg, Training& t);
Position plan_run(const TrainConfig& cfg, Training& t, const std::optional<Continued>& from);
// Writes the checkpoint of `pos` (when there is a directory); returns its path.
std::string save(const TrainConfig& cfg, Training& t, const Position& pos);
[[noreturn]] void stop_for_signal(const TrainConfig& cfg, Training& t, const Position& pos, Progress& progress);

// train_loop.cpp: evaluation and the epoch loop.
// Under DDP each rank evaluates its share of the test set and the sums are
// added over the ranks (Note [Training ranks]).
EvalResult evaluate(nn::Module& model, data::DataLoader& loader, bool channels_last,
                    const RankContext* ranks = nullptr);
// Before evaluating through the model itself: rank 0's buffers everywhere
// (and under zero the full weights in the module).
void ready_to_evaluate(Training& t);
// The epoch loop from `pos` on, until the epochs or --steps run out.
LoopResult train_loop(const TrainConfig& cfg, Training& t, Position& pos, RunLog* log, StepTracer& tracer);

}  // namespace image_train
}  // namespace chorus::app
