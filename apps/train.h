// `chorus train`: the training driver behind the command line.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "chorus/core/device.h"
#include "memory_check.h"

namespace chorus::app {

struct TrainConfig {
  std::string model = "cnn";
  std::string data = "fashion-mnist";
  std::optional<std::string> data_dir;  // unset: the data set's default folder
  std::string devices = "";  // empty: the first GPU, or cpu
  std::string strategy = "single";
  double bucket_mb = 25;  // dp: gradients summed in buckets of this many MiB (0: one bucket)
  bool dp_broadcast = false;  // dp: weights broadcast after each step instead of replicated updates
  bool dp_gather_output = false;  // dp: outputs gathered and the loss computed on the first device
  std::optional<std::string> dp_all_reduce;  // dp: auto | nccl | copy-engine | in-update (unset: CHORUS_DP_ALLREDUCE, else auto)
  int64_t epochs = 1;
  std::optional<int64_t> steps;  // unset: no limit besides epochs
  int64_t batch_size = 64;  // per device
  std::optional<double> lr;  // unset: the optimizer's default (default_lr)
  double momentum = 0.9;
  double weight_decay = 5e-4;
  std::string optimizer = "sgd";
  double label_smoothing = 0.0;
  std::string precision = "fp32";
  uint64_t seed = 0;
  int workers = 2;
  int64_t synthetic_size = 10000;
  std::optional<std::string> checkpoint_dir;  // unset: no checkpoints
  int64_t checkpoint_every = 0;  // steps; 0: at the end of each epoch only
  bool resume = false;
  bool start_fresh = false;               // --resume: start over when no checkpoint can be read
  std::vector<std::string> allow_change;  // --resume: config fields that may differ (kResumeChangeable)
  std::optional<std::string> metrics;     // unset: no metrics file
  std::optional<std::string> tensorboard; // TensorBoard event files under this folder (apps/run_log.h)
  bool tensorboard_all_ranks = false;     // ddp: every rank writes its own (default: rank 0 only)
  std::optional<std::string> trace;       // a Chrome/Perfetto trace of --trace-steps (apps/step_trace.h)
  std::string trace_steps = "3-5";        // first-last, 1-based
  std::optional<std::string> plot;        // curves redrawn at each epoch end (.svg or .png; apps/plot.h)
  bool json = false;
  int64_t log_every = 20;
  bool quiet = false;
  bool no_cuda_graphs = false;   // one CUDA device: eager steps instead of a replayed graph
  bool channels_last = false;    // NHWC weights and batches (Note [Convolution layouts]); an error off CUDA
  bool no_channels_last = false; // NCHW on GPUs too (channels-last is the default where every device is a GPU)
  MemoryPlanFlags memory;        // --memory-plan, --ignore-memory-plan, --memory-limit-gib (apps/memory_check.h)
  // --strategy ddp
  bool sync_bn = false;          // batch-norm statistics over all ranks
  std::string comm_hook = "allreduce";  // allreduce | bf16 (gradients travel as bfloat16)
  double dist_timeout_s = 300;   // rendezvous and every collective
  double stats_every_s = 60;     // rank 0's line on the ranks' step times (Note [Slow ranks named]); 0: never
  // --strategy zero (data_parallel/sharded.h): unset stage: 1
  std::optional<int> zero_stage;
  bool reshard_after_forward = true;  // stage 3: free a unit's gathered weights after its forward
  bool zero_prefetch = true;          // gathers issued ahead of use (ShardOptions::prefetch)
  bool hybrid = false;                // shard inside a node, replicate across nodes
  std::optional<std::string> zero_param_dtype;  // bf16 | fp32 (unset: bf16 under --precision bf16)
  // --strategy pipeline (unset: the defaults below; set with another strategy: an error)
  std::optional<int64_t> micro_batches;    // default 4
  std::optional<std::string> schedule;     // gpipe | 1f1b (default) | interleaved
  std::optional<std::string> balance;      // "14,15" layers per stage, or time | memory (default: time)
  std::optional<std::string> recompute;    // never (default) | except_last | always
  std::optional<int64_t> virtual_stages;   // interleaved: stages per device (default 2)

  // Throws ValueError naming the first bad option.
  void validate() const;
  nlohmann::json to_json() const;
};

// Runs the whole job; returns the closing summary (null on the ranks of a
// distributed run other than rank 0, which print nothing).
nlohmann::ordered_json run_train(const TrainConfig& cfg);

}  // namespace chorus::app
