// TrainConfig (train.h): the checks of `chorus train`'s options, and the
// record of them that checkpoints and metrics keep.
#include "train.h"

#include <algorithm>
#include <cmath>

#include "chorus/core/error.h"
#include "chorus/models/models.h"
#include "resume_checks.h"
#include "step_trace.h"
#include "train_dist.h"
#include "train_pipeline.h"
#include "train_step.h"
#include "train_zero.h"

namespace chorus::app {

void TrainConfig::validate() const {
  auto names = models::model_names();
  bool wrn = model.rfind("wrn-", 0) == 0;
  CHORUS_CHECK(wrn || std::find(names.begin(), names.end(), model) != names.end(), "unknown model '", model,
               "' (expected mlp, cnn, resnet20, wrn-16-4 or wrn-28-10)");
  CHORUS_CHECK(data == "fashion-mnist" || data == "mnist" || data == "cifar10" || data == "synthetic",
               "unknown data set '", data, "' (expected fashion-mnist, mnist, cifar10 or synthetic)");
  CHORUS_CHECK(strategy == "single" || strategy == "dp" || strategy == "ddp" || strategy == "pipeline" || strategy == "zero",
               "unknown strategy '", strategy, "' (expected single, dp, ddp, zero or pipeline)");
  validate_zero_options(*this);
  // An image model's convolutions take float32 weights under autocast's
  // per-use casts: no 16-bit gathered parameters (--zero-param-dtype is GPTs').
  CHORUS_CHECK(!zero_param_dtype, "--zero-param-dtype is offered for GPT models; ", model,
               " gathers its weights in float32");
  CHORUS_CHECK(!channels_last || strategy != "zero", "--channels-last is not offered with --strategy zero yet (a shard is a "
               "range of a parameter's row-major elements); zero runs train NCHW");
  if (strategy == "pipeline") {
    CHORUS_CHECK(!micro_batches || (*micro_batches >= 1 && *micro_batches <= batch_size), "--micro-batches must be from 1 to the batch size (",
                 batch_size, "), got ", micro_batches.value_or(0));
    if (schedule) (void)parallel::parse_schedule(*schedule);
    if (recompute) (void)parallel::parse_checkpoint(*recompute);
    if (balance) (void)parse_balance(*balance);
    CHORUS_CHECK(!virtual_stages || (*virtual_stages >= 1 && *virtual_stages <= 64),
                 "--virtual-stages must be from 1 to 64, got ", virtual_stages.value_or(0));
    CHORUS_CHECK(!virtual_stages || schedule.value_or("") == "interleaved", "--virtual-stages goes with --schedule interleaved");
  } else {
    const char* given = micro_batches ? "--micro-batches" : schedule ? "--schedule" : balance ? "--balance"
                        : recompute ? "--recompute" : virtual_stages ? "--virtual-stages" : nullptr;
    CHORUS_CHECK(given == nullptr, given ? given : "", " goes with --strategy pipeline");
  }
  if (strategy == "ddp" || strategy == "zero") ddp_launch_env(strategy);  // says how to launch when nothing did
  CHORUS_CHECK(!sync_bn || strategy == "ddp" || strategy == "zero", "--sync-bn goes with --strategy ddp or zero");
  CHORUS_CHECK(!dp_broadcast || strategy == "dp", "--dp-broadcast goes with --strategy dp");
  CHORUS_CHECK(!dp_gather_output || strategy == "dp", "--dp-gather-output goes with --strategy dp");
  check_dp_all_reduce(dp_all_reduce, strategy, dp_broadcast);
  CHORUS_CHECK(comm_hook != "noop",
               "--comm-hook noop communicates nothing (the ranks would train apart): it is for chorus bench's headroom "
               "analysis, not for training");
  CHORUS_CHECK(comm_hook == "allreduce" || comm_hook == "bf16", "--comm-hook must be allreduce or bf16, got '",
               comm_hook, "'");
  CHORUS_CHECK(dist_timeout_s > 0, "--dist-timeout must be positive, got ", dist_timeout_s);
  CHORUS_CHECK(std::isfinite(stats_every_s) && stats_every_s >= 0, "--stats-every must be a number of seconds >= 0, got ", stats_every_s);
  CHORUS_CHECK(precision == "fp32" || precision == "bf16", "unknown precision '", precision, "' (expected fp32 or bf16)");
  CHORUS_CHECK(optimizer == "sgd" || optimizer == "adamw", "unknown optimizer '", optimizer, "' (expected sgd or adamw)");
  CHORUS_CHECK(batch_size > 0, "--batch-size must be positive, got ", batch_size);
  CHORUS_CHECK(std::isfinite(bucket_mb) && bucket_mb >= 0, "--bucket-mb must be a number >= 0, got ", bucket_mb);
  CHORUS_CHECK(epochs > 0, "--epochs must be positive, got ", epochs);
  CHORUS_CHECK(!steps || *steps > 0, "--steps must be positive, got ", steps.value_or(0));
  CHORUS_CHECK(!lr || (std::isfinite(*lr) && *lr >= 0), "--lr must be a non-negative number, got ", lr.value_or(0));
  CHORUS_CHECK(workers >= 0, "--workers must be >= 0, got ", workers);
  CHORUS_CHECK(synthetic_size > 0, "--synthetic-size must be positive, got ", synthetic_size);
  CHORUS_CHECK(checkpoint_every >= 0, "--checkpoint-every must be >= 0, got ", checkpoint_every);
  CHORUS_CHECK(!data_dir || !data_dir->empty(), "--data-dir is empty: name a folder, or leave --data-dir out for the default");
  CHORUS_CHECK(!checkpoint_dir || !checkpoint_dir->empty(),
               "--checkpoint-dir is empty: name a folder, or leave --checkpoint-dir out for no checkpoints");
  CHORUS_CHECK(!metrics || !metrics->empty(), "--metrics is empty: name a file, or leave --metrics out for no metrics");
  CHORUS_CHECK(!tensorboard || !tensorboard->empty(),
               "--tensorboard is empty: name a folder, or leave --tensorboard out for no event files");
  CHORUS_CHECK(!tensorboard_all_ranks || tensorboard, "--tensorboard-all-ranks goes with --tensorboard DIR");
  CHORUS_CHECK(!plot || (plot->size() > 4 && (plot->substr(plot->size() - 4) == ".svg" || plot->substr(plot->size() - 4) == ".png")),
               "--plot must name a .svg or .png file, got '", plot.value_or(""), "'");
  CHORUS_CHECK(!trace || !trace->empty(), "--trace is empty: name a .json file, or leave --trace out");
  (void)parse_trace_steps(trace_steps);
  CHORUS_CHECK(!resume || checkpoint_dir, "--resume needs --checkpoint-dir");
  CHORUS_CHECK(!start_fresh || resume, "--start-fresh goes with --resume");
  CHORUS_CHECK(allow_change.empty() || resume, "--allow-change goes with --resume");
  for (const std::string& f : allow_change)
    CHORUS_CHECK(std::find(kResumeChangeable.begin(), kResumeChangeable.end(), f) != kResumeChangeable.end(),
                 "--allow-change ", f, ": only epochs, steps, data_dir, devices and strategy may change on --resume");
  CHORUS_CHECK(log_every > 0, "--log-every must be positive, got ", log_every);
  CHORUS_CHECK(label_smoothing >= 0 && label_smoothing < 1, "--label-smoothing must be in [0, 1), got ", label_smoothing);
}

nlohmann::json TrainConfig::to_json() const {
  nlohmann::json j = {{"model", model}, {"data", data}, {"data_dir", data_dir ? nlohmann::json(*data_dir) : nlohmann::json(nullptr)}, {"devices", devices}, {"strategy", strategy},
          {"epochs", epochs}, {"steps", steps ? nlohmann::json(*steps) : nlohmann::json(nullptr)}, {"batch_size", batch_size}, {"lr", lr ? nlohmann::json(*lr) : nlohmann::json(nullptr)}, {"momentum", momentum},
          {"weight_decay", weight_decay}, {"optimizer", optimizer}, {"label_smoothing", label_smoothing},
          {"precision", precision}, {"seed", seed}, {"synthetic_size", synthetic_size}};
  if (sync_bn) j["sync_bn"] = true;  // only when set: checkpoints from before it existed still compare
  return j;
}

}  // namespace chorus::app
