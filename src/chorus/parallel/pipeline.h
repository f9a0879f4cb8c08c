// Pipeline parallelism: a Sequential split into stages on several devices
// (or processes), each batch cut into micro-batches that flow through the
// stages so that the devices work at once (GPipe, torchgpipe; PipeDream's
// 1F1B; Megatron-LM's interleaved 1F1B).
//
//   auto layers = models::as_sequential(model);             // or any nn::Sequential
//   parallel::Pipeline pipe(layers, {14, 15}, parse_devices("cuda:0,cuda:1"),
//                           {.micro_batches = 8, .schedule = parallel::Schedule::OneFOneB});
//   optim::SGD opt(pipe.parameters(), ...);                 // one model: the optimizer sees every stage
//   opt.zero_grad();
//   auto r = pipe.train_step(x, y, [](const Tensor& out, const Tensor& t) { return cross_entropy(out, t); });
//   opt.step();                                            // r.loss: the batch's mean loss
//
// train_step runs the forward and backward of every micro-batch in the
// schedule's order (parallel/pipeline_schedule.h), one host thread per
// device; gradients accumulate in the parameters exactly as one backward of
// the whole batch's mean loss would (each micro-batch's loss is weighted by
// its share of the batch). forward() alone runs the micro-batches through the
// stages and returns the joined output with its autograd graph, for
// evaluation or a loss of the caller's own.
//
// Note [Pipeline transfers]: an activation leaves its stage detached and
// arrives on the next stage's device as a new leaf; its gradient travels
// back the same way. On GPUs each copy runs on a stream of its own (one per
// receiving device and direction), ordered by events after the producer's
// work, so transfers overlap the compute of both stages; the receiver's
// compute stream waits for the copy's event only when it needs the tensor.
//
// state_dict names are the Sequential's: the pipeline registers it under no
// prefix (Note [State dict names] in nn/module.h).
#pragma once

#include <array>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "chorus/core/stream.h"
#include "chorus/distributed/process_group.h"
#include "chorus/nn/layers.h"
#include "chorus/parallel/deferred_batch_norm.h"
#include "chorus/parallel/pipeline_links.h"
#include "chorus/parallel/pipeline_schedule.h"

namespace chorus::parallel {

// Activation recomputation per micro-batch (torchgpipe's `checkpoint`): a
// checkpointed micro-batch keeps only its stage inputs and runs the stage's
// forward again during its backward.
enum class Checkpoint { Never, ExceptLast, Always };
Checkpoint parse_checkpoint(const std::string& name);  // "never", "except_last", "always"
std::string checkpoint_name(Checkpoint c);

struct PipelineOptions {
  int64_t micro_batches = 1;
  Schedule schedule = Schedule::OneFOneB;
  Checkpoint checkpoint = Checkpoint::Never;
  // Running statistics of batch norm from the whole mini-batch, not per
  // micro-batch (parallel/deferred_batch_norm.h).
  bool deferred_batch_norm = false;
  // With an empty balance: stages per device (0: 2 for interleaved, else 1).
  int64_t virtual_stages = 0;
  // Time every task (events on GPUs, each task issued behind a gate so they
  // time the device alone; a host synchronisation per step) for
  // PipelineStats' busy time and bubble. The gates make such a step slower
  // than an unmeasured one: compare busy time with an unmeasured step's time
  // (chorus bench does) for the bubble of the real step.
  bool measure = false;
  // train_step's StepResult::output, the batch's output joined: false keeps
  // no micro-batch's output past its loss (a GPT's logits: [tokens, vocab]
  // each, 206 MB a micro-batch of 2 x 1024 tokens for gpt2-xl in bf16, all
  // M of them held to the step's end and then copied into one tensor that
  // GPT training never reads).
  bool keep_output = true;
  // Stages over processes: stage s runs on rank s % size (`devices` is then
  // this rank's one device): one stage per rank, or several with the
  // interleaved schedule (virtual_stages, or a balance of size x V counts).
  // Activations and gradients travel by send/recv, one 2-rank group per
  // direction and link (Note [Pipeline links] in parallel/pipeline_links.h).
  dist::ProcessGroupPtr stage_group;
  // Data parallelism over pipelines (the seeds' "Distributed Model and Data
  // Parallel"): every rank of this group runs a replica of the whole
  // pipeline on its own share of the batch, and each stage's gradients are
  // averaged over the group as soon as that stage's last backward is done
  // (while the other stages still run theirs), packed into one flat buffer
  // per dtype of which the gradients are views (as data_parallel/reducer.h's
  // buckets). Each stage gets a subgroup of its own, so the stages' threads
  // never race for one communicator. Gloo: any CPU devices; NCCL: the stages
  // must be on the group's device. With a stage group too, the data group
  // joins ranks at the same place of their pipelines (the same stage-group
  // rank: ValueError otherwise), each replica's stages averaged over it.
  dist::ProcessGroupPtr data_group;
};

// Note [Pipelines and CUDA graphs]: a pipelined step can be captured whole
// as one CUDA graph over its devices (GraphedStep with options.devices = the
// stages' devices): each device's thread issues its stage tasks to that
// device's capture stream, the stage-to-stage copies run on the copy streams,
// which join the capture through the events that order them (Note [Pipeline
// transfers]), and a replay is one launch per step. Host
// effects of a step happen once per replay: init_run's reservation of the
// micro-batch generators from the process's random stream is registered with
// on_each_replay inside a capture -- without it, every later draw of the
// program (the next batch) differed from an eager run's from the second
// replay on, which is how a first attempt (session 13) drifted from its
// eager test. Random numbers drawn inside a stage (dropout) still make the
// capture fail (CaptureError) and the step run eagerly. Over processes
// (stage_group) the send/recv headers are read on the host: not capturable.
struct PipelineStats {
  double step_ms = 0;            // host wall time of the step (measure: after synchronising)
  std::vector<double> busy_ms;   // per device: time spent in its tasks (measure only)
  double bubble = 0;             // 1 - mean(busy) / step_ms of this measured step (measure only)
};

using LossFn = std::function<Tensor(const Tensor& output, const Tensor& target)>;

class Pipeline : public nn::Module {
 public:
  // `balance[i]` consecutive layers form stage i (empty: as even a split by
  // layer count as possible). Stage i runs on devices[i % devices.size()].
  // ValueError (one line) when the balance does not add up to the number of
  // layers or has an empty stage, there are more stages than layers, the
  // stages cannot be spread evenly over the devices, a device does not
  // exist, or a device is listed twice.
  Pipeline(std::shared_ptr<nn::Sequential> layers, std::vector<int64_t> balance, std::vector<Device> devices,
           PipelineOptions options = {});
  // The stages given as Sequentials: their layers laid end to end, numbered
  // as one Sequential would number them ("0.weight" ... "8.weight"), so the
  // names do not depend on where the model was cut.
  Pipeline(const std::vector<std::shared_ptr<nn::Sequential>>& stages, std::vector<Device> devices,
           PipelineOptions options = {});

  // The micro-batches through every stage (GPipe's forward); the output is
  // on the last stage's device. Differentiable: a backward of it reaches
  // every stage (the backward engine runs the devices at once).
  Tensor forward(const Tensor& x) override;

  struct StepResult {
    Tensor loss;    // the batch's mean loss (detached), on the last stage's device
    Tensor output;  // the joined output (detached), on the last stage's device (undefined without keep_output)
  };
  // One training step's forward and backward by the schedule. `loss_fn`
  // returns the mean loss of a micro-batch. ValueError when the batch is
  // smaller than the number of micro-batches. With a stage group, `x` is
  // read on the rank of the first stage and `target` on the rank of the last
  // (others may pass any tensor with the batch size in dimension 0); the
  // result is defined on the last stage's rank.
  StepResult train_step(const Tensor& x, const Tensor& target, const LossFn& loss_fn);

  // The batch's mean loss without gradients (validation): the forwards of
  // every micro-batch (min(micro_batches, batch) of them) through the stages,
  // under no grad, nothing kept. Over processes every rank of the stage group
  // calls it with the same batch size; as train_step, `x` is read on the first
  // stage's rank and `target` on the last's, and the result is defined on the
  // last stage's rank only (undefined elsewhere).
  Tensor evaluate(const Tensor& x, const Tensor& target, const LossFn& loss_fn);

  const PipelineStats& last_stats() const { return stats_; }
  void set_measure(bool on) { opts_.measure = on; }
  int64_t num_stages() const { return static_cast<int64_t>(stages_.size()); }
  const std::vector<int64_t>& balance() const { return balance_; }
  const std::vector<Device>& devices() const { return devices_; }
  Device stage_device(int64_t stage) const { return stages_.at(static_cast<size_t>(stage)).device; }
  const PipelineOptions& options() const { return opts_; }
  // Whether this process runs stage `stage` (always, without a stage group).
  bool is_local(int64_t stage) const;
  // The parameters of this process's stages (all of them without a stage group).
  std::vector<Tensor> local_parameters() const;
  std::string extra_repr() const override;

 protected:
  std::shared_ptr<nn::Module> make_empty() const override;

 private:
  struct Stage {
    Device device;
    int64_t first = 0, last = 0;  // layers [first, last)
    std::vector<nn::ModulePtr> layers;
    std::vector<std::shared_ptr<DeferredBatchNorm>> deferred;
  };
  struct Run;
  void note_copy(Run& run, const Device& dst, int dir) const;
  void init_run(Run& run, int64_t batch, int micro_batches) const;
  void feed(Run& run, const Tensor& x, const Tensor& target) const;
  void set_lists(Run& run, std::vector<std::vector<PipeTask>> lists, bool forwards_only) const;
  // pipeline_process.cpp: the process groups.
  void check_link_order(const std::vector<std::vector<PipeTask>>& lists, int stages, int micro_batches,
                        bool forwards_only) const;
  void check_process_stages(int64_t layers) const;
  void make_groups(int64_t places);
  void reduce_stage_gradients(size_t s);
  Tensor run_stage(size_t s, const Tensor& x) const;
  void execute(Run& run);
  void run_task(Run& run, const PipeTask& t, size_t device_index);
  // Note [Pipeline transfers]: per GPU, the streams of arriving activations (0) and gradients (1).
  const std::optional<Stream>& copy_stream(const Device& dst, int dir) const;

  std::shared_ptr<nn::Sequential> seq_;
  std::vector<int64_t> balance_;
  std::vector<Device> devices_;
  PipelineOptions opts_;
  std::vector<Stage> stages_;
  PipelineStats stats_;
  std::vector<std::pair<Device, std::array<std::optional<Stream>, 2>>> copy_streams_;
  std::vector<dist::ProcessGroupPtr> stage_data_groups_;  // [stage], from data_group
  // Over processes: a communicator per direction and link, so that on NCCL
  // no send queues behind a receive (Note [Pipeline links]).
  PipelineLinks links_;
  // The configurations whose lists passed link_order_mismatch (check_link_order):
  // (forwards only, schedule, ranks, stages, micro-batches).
  using LinkOrderKey = std::tuple<bool, int, int, int, int>;
  mutable std::set<LinkOrderKey> links_checked_;
};

}  // namespace chorus::parallel
