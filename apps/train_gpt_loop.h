// The step loop of `chorus train --model gpt2|...` without --mesh
// (train_gpt.cpp sets the run up and calls it): GptTraining, what the set-up
// hands the loop, and run_gpt_loop -- the steps (gradient accumulation,
// clipping, Note [GPT schedule]'s learning rate, a CUDA graph of the whole
// step), periodic reads of the loss with the stats line, --trace, validation,
// checkpoints, the stop on a signal, and the closing summary.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include <nlohmann/json.hpp>

#include "chorus/core/dtype.h"
#include "chorus/core/tensor.h"
#include "chorus/data/tokens.h"
#include "chorus/data_parallel/memory_plan.h"
#include "chorus/models/gpt.h"
#include "chorus/models/gpt_pipeline.h"
#include "chorus/nn/module.h"
#include "chorus/optim/adamw.h"
#include "train_dist.h"
#include "train_gpt.h"

namespace chorus::app {

class RunLog;

// One GPT run as set up: devices, ranks, the model and its wrappers, the
// optimizer, the data windows, and where this run starts (a resumed one
// within its checkpoint's curve, Note [Progress in samples]).
struct GptTraining {
  std::vector<Device> devices;
  std::optional<RankContext> ranks;
  models::GPTConfig cfg;
  std::shared_ptr<models::GPT> model;
  nn::ModulePtr net;  // the model, or its DDP wrapper
  std::shared_ptr<dist::DistributedDataParallel> ddp;
  std::shared_ptr<dist::ShardedDataParallel> sdp;  // --strategy zero
  // --strategy pipeline: the stages (Note [GPT as pipeline stages]).
  std::optional<models::GPTPipelineLayers> tied;
  std::shared_ptr<parallel::Pipeline> pipe;
  std::vector<Tensor> params;  // what the optimizer updates (under zero: this rank's pieces)
  std::unique_ptr<optim::AdamW> opt;
  std::unique_ptr<data::TokenWindows> train, val;
  // The memory plan, when one was made: the first steps' measured peak is
  // printed beside it (Note [Measured beside the plan]).
  std::optional<dist::MemoryPlan> plan;
  int64_t seq = 0, batch = 0, accum = 1;
  int64_t start = 0, start_tokens = 0;  // this run's first step and the tokens consumed before it
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

// The settings a checkpoint records (and a resumed run compares).
nlohmann::json gpt_config_json(const TrainConfig& tc, const GptOptions& g, const GptTraining& r);

// Runs r's steps from r.start to r.total_steps (or a stop signal: then the
// stop checkpoint is written and Interrupted thrown), then validates, writes
// --save-hf, and returns the summary (null on ranks other than 0). `t_start`:
// when the run began, for its seconds.
nlohmann::ordered_json run_gpt_loop(const TrainConfig& tc, const GptOptions& g, GptTraining& r, RunLog& log,
                                    std::chrono::steady_clock::time_point t_start);

}  // namespace chorus::app
