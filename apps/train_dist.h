// `chorus train --strategy ddp` (and zero: apps/train_zero.h): what a rank of
// a distributed run adds to the single-process driver (apps/train.cpp) -- its
// devices, its process group, the model wrapped in DistributedDataParallel
// (or ShardedDataParallel), and the points where the ranks must agree: which
// checkpoint to resume, when to stop, the sums behind the reported figures.
//
// Note [Training ranks]: every rank runs the same loop on its own shard of
// each epoch (data::DistributedSampler: equal shares, reshuffled by epoch
// with no call from the loop). Rank 0 alone prints, writes metrics and writes
// checkpoints (the others wait at a barrier, so a checkpoint is complete
// before anyone goes on); it alone picks the checkpoint to resume (skipping
// unreadable ones, Note [Unreadable checkpoints]) and the others load the
// same one. The figures shown are over all ranks: the training window's loss
// and accuracy and the test set's (each rank evaluates every world-size-th
// test example) are summed with one all-reduce, issued where the host reads
// the figures anyway. A stop signal is agreed on through the store, a step or
// two after it came (Note [Stopping ranks together]).
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "chorus/data_parallel/ddp.h"
#include "chorus/distributed/launch_env.h"
#include "chorus/distributed/process_group.h"
#include "chorus/io/checkpoint.h"

namespace chorus::app {

struct TrainConfig;

struct RankContext {
  dist::LaunchEnv env;
  dist::ProcessGroupPtr group;
  bool leader() const { return env.rank == 0; }
};

// The launcher's environment, or a ValueError saying how to launch.
// `strategy` and `command` name what needs the launcher in the message.
dist::LaunchEnv ddp_launch_env(const std::string& strategy = "ddp", const std::string& command = "train");
// This rank's devices: `--devices cuda` (or nothing, with GPUs) is
// cuda:LOCAL_RANK, `cpu` (or nothing, without GPUs) one CPU device; an
// explicit list of several is a DataParallel inside the rank.
std::vector<Device> ddp_devices(const std::string& devices, const dist::LaunchEnv& env);
// Joins the job's process group (nccl for GPUs, gloo for CPUs).
RankContext join_job(const dist::LaunchEnv& env, const Device& device, double timeout_s);

// Sums `values` (host numbers) over the ranks (one all-reduce).
std::vector<double> sum_over_ranks(const RankContext& rc, const std::vector<double>& values);

// Note [Slow ranks named]: under DDP every rank's step takes as long as the
// slowest one's, since all meet at the gradients' all-reduce. What tells the
// ranks apart is the time each spends outside that wait: the host time of its
// steps (data loading included) less DistributedDataParallel's
// gradient_wait_seconds. Every --stats-every seconds (decided by rank 0 and
// agreed on through the all-reduce a log window does anyway) the ranks add
// their per-step figures into one vector (each rank its own slots: one more
// all-reduce, only then) and rank 0 prints one line:
//   step 1200: 31.2 ms median, slowest rank 3 at 38.9 ms (+25%, data loading)
// -- the median over the other ranks of that busy time per step, the slowest
// rank and its excess over that median, and whether the excess is in data
// loading or in compute (the rest of the step: forward, backward, optimizer).
// Note [Late arrivals]: under CUDA graphs (or any step whose collectives the
// host does not wait for) the ranks meet on the GPUs, inside NCCL's kernels,
// so no rank's host time per step tells the slow one apart: a rank stopped
// now and then loses its time wherever its host happens to be. What does
// tell is when each rank's host reaches the log window's meeting point
// (the loss read-out every --log-every steps): the others get there and
// wait, the slow one comes late. So every rank notes the system clock there
// (arrive()), the report sums them, and each rank's lateness behind the
// earliest, per step, is added to its busy time. Eager DDP's ranks meet in
// the gradient all-reduce of the last step, so they arrive together and
// their lateness is near 0: the busy times name the rank, as before. The
// clocks of one machine agree; across machines the lateness is as good as
// their clocks' agreement (NTP: about a millisecond).
class RankTimes {
 public:
  void add_step(double step_s, double data_s) {
    ++steps_;
    step_s_ += step_s;
    data_s_ += data_s;
  }
  // At the log window's meeting point, every rank, the same windows.
  void arrive();
  // Every rank calls it at the same step; `wait_s`: the DDP's
  // gradient_wait_seconds() now. Returns rank 0's line ("" elsewhere, or when
  // no step was timed) and starts the next period.
  std::string report(const RankContext& rc, int64_t step, double wait_s);

 private:
  int64_t steps_ = 0;
  double step_s_ = 0, data_s_ = 0, wait_at_start_ = 0;
  double arrivals_s_ = 0;  // sum of arrive()'s clock readings, from kClockBase
};

// Note [Options every rank shares]: ranks given different training options
// (another --lr, --seed, --batch-size, data set, ...) used to train on
// silently while their replicas drifted apart; only the model was compared.
// At the start each rank writes a fingerprint of every setting that must
// agree (a JSON object: the options by name, its number of devices, and the
// data sets' sizes and a checksum of their first and last examples) to the
// store; rank 0 compares each rank's with its own and writes one verdict that
// every rank reads, so all of them stop with the same one line naming the
// first rank and option that differ, before any collective runs.
void check_same_options(const RankContext& rc, const nlohmann::json& fingerprint);

// Note [Stopping ranks together]: a signal reaches the ranks at slightly
// different steps, and they must stop after the same one (each writes its
// part of the stop checkpoint there, and a rank that went on would wait for
// the others in its next collective). They agreed where they summed the
// figures, every --log-every steps, which could be long after the signal:
// the launcher killed them before that, with no stop checkpoint. Now a rank
// that has a signal proposes, in the store, to stop after step s + 2 (s: the
// step it just finished); the first proposal stands (compare-and-set), and
// every rank looks for it after each step (one store round trip). The
// gradient all-reduce of each step keeps the ranks within one step of each
// other, so no rank has passed s + 2 when the proposal appears.
class StopAgreement {
 public:
  explicit StopAgreement(const RankContext& rc) : rc_(rc) {}
  // After step `step` (steps done): true when every rank stops here.
  bool stop_after(int64_t step, bool signalled);

 private:
  const RankContext& rc_;
  int64_t stop_at_ = -1;  // agreed; -1: not yet
  bool proposed_ = false;
};

// Rank 0's choice of checkpoint (its path, or "" for none) to every rank.
std::string agree_on_checkpoint(const RankContext& rc, const std::optional<std::string>& leader_choice);

}  // namespace chorus::app
