// One training step, shared by `chorus train` and `chorus bench`: forward and
// loss under autocast, zero_grad, backward, optimizer step. Nothing in it
// waits for the device.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "chorus/core/dtype.h"
#include "chorus/core/tensor.h"
#include "chorus/nn/module.h"
#include "chorus/optim/optimizer.h"
#include "chorus/parallel/data_parallel.h"
#include "chorus/parallel/graphed_step.h"
#include "chorus/parallel/pipeline.h"

namespace chorus::app {

// `model` as the step runs it for a strategy: the model itself ("single"), or
// a DataParallel over `devices` with gradient buckets of `bucket_mb` MiB, a
// last bucket of at most `last_bucket_mb` (unset: the default) and the
// gradient sums of `dp_all_reduce` (dp_options) ("dp").
// Given `opt` (over model's parameters), the DataParallel's replicas step
// their own weights with it (Note [Replicated updates]) instead of receiving
// them from the first device after each step (--dp-broadcast).
nn::ModulePtr wrap_for_strategy(const nn::ModulePtr& model, const std::string& strategy,
                                const std::vector<Device>& devices, double bucket_mb,
                                std::optional<double> last_bucket_mb = std::nullopt,
                                optim::Optimizer* opt = nullptr,
                                const std::optional<std::string>& dp_all_reduce = std::nullopt);

// --dp-all-reduce: how a DataParallel with replicated updates sums the
// gradients: auto, nccl, copy-engine or in-update (dist::GradSumMethod; Note
// [Gradient sums in the update] in data_parallel/reducer.h). Unset: as
// CHORUS_DP_ALLREDUCE says (default auto). ValueError for another value (or
// a bad environment switch of dp_options), or with a strategy other than dp
// or with --dp-broadcast (which sums with a reduce, not an all-reduce).
void check_dp_all_reduce(const std::optional<std::string>& method, const std::string& strategy, bool dp_broadcast);
// The process's counts of copy-engine all-reduces and gradient exchanges, to
// tell afterwards which of them a run used.
struct CommCounts {
  uint64_t copy_engine = 0, exchanges = 0;
};
CommCounts comm_counts();
// What summed a `chorus bench --json` row's gradients since `before`, with
// DataParallel options `o`: "in-update" (gradients exchanged, the sum in the
// optimizer's update), "copy-engine", else "nccl" (with "copy engines
// unavailable" when they were asked for: no peer access); "adds" on CPU
// devices. dp_grads_name: "in-place" or "packed".
std::string dp_all_reduce_name(const CommCounts& before, const Device& device, const parallel::DataParallelOptions& o);
std::string dp_grads_name(const CommCounts& before, const Device& device, const parallel::DataParallelOptions& o);

struct TrainStep {
  nn::ModulePtr net;                     // what forward runs (the model or its wrapper)
  optim::Optimizer* opt = nullptr;       // over the model's parameters
  std::optional<DType> autocast;         // --precision bf16: bf16 compute, fp32 weights and loss
  double label_smoothing = 0.0;
  // --strategy pipeline: forward and backward by the pipeline's schedule
  // (Pipeline::train_step) instead of net->forward + backward.
  parallel::Pipeline* pipeline = nullptr;
  // A DataParallel `net`: each replica computes the loss of its chunk and one
  // backward starts from all of them (Note [Per-replica losses]); true: the
  // outputs gathered on the first device and the loss computed there
  // (--dp-gather-output).
  bool dp_gather_output = false;

  struct Result {
    Tensor logits, loss;
  };
  // Host milliseconds spent issuing each phase, added to by run() when asked
  // for (where an issue-bound step spends its time).
  struct Phases {
    double forward_ms = 0, backward_ms = 0, optim_ms = 0;
  };
  Result run(const Tensor& x, const Tensor& y, Phases* phases = nullptr) const;
  // The step run eagerly even when a graph is enabled (a pipeline's measured
  // steps time every task).
  Result run_eager(const Tensor& x, const Tensor& y, Phases* phases = nullptr) const;

  // CUDA graphs (parallel/graphed_step.h): once enabled, run() replays the
  // captured step (after its warm-up), and falls back to eager with one line
  // where it cannot (options.devices: every device the step runs on, the
  // inputs' first; a pipeline: its devices). Returns whether it was enabled.
  // Phases are not timed for replayed steps.
  bool enable_cuda_graphs(parallel::GraphedStepOptions options = {});
  std::shared_ptr<parallel::GraphedStep> graph;
};

// Whether a step over `devices` with this strategy can be captured as a CUDA
// graph: "single", or "ddp" or "zero" with one device per process, on one CUDA device;
// "dp" over CUDA devices, the inputs on the first: one graph spans them all;
// "pipeline" over CUDA devices likewise (Note [Pipelines and CUDA graphs] in
// parallel/pipeline.h).
bool cuda_graphs_apply(const std::string& strategy, const std::vector<Device>& devices);

}  // namespace chorus::app
