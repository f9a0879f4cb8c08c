// DataParallel: one model, several devices, one process (Torch7's
// DataParallelTable, PyTorch's nn.DataParallel).
//
//   auto dp = std::make_shared<parallel::DataParallel>(model, parse_devices("cuda:0,cuda:1"));
//   Tensor loss = nn::functional::cross_entropy(dp->forward(x), y);  // x split over the devices
//   opt.zero_grad(); loss.backward(); opt.step();  // opt over model->parameters(); no syncParameters
//
// The public API is the class below (options first); the Notes after it say
// how it works.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "chorus/core/stream.h"
#include "chorus/data_parallel/flat_layout.h"
#include "chorus/data_parallel/in_process_hooks.h"
#include "chorus/data_parallel/reducer.h"
#include "chorus/nn/module.h"
#include "chorus/parallel/device_threads.h"

namespace chorus::dist {
class ReplicaStatsGroup;
}

namespace chorus::parallel {

struct DataParallelOptions {
  int64_t dim = 0;                       // the batch dimension of every input tensor
  std::optional<Device> output_device;   // default: the first device
  bool gather_output = true;             // false: per-replica outputs, left on their devices
  // Gradients are summed across replicas in buckets of about this many bytes
  // (Note [Gradient buckets] in data_parallel/grad_buckets.h); 0: one bucket, summed at
  // the end. Negative: ValueError.
  int64_t bucket_bytes = int64_t{25} << 20;
  // The first layers' gradients in a bucket of their own of at most this many
  // bytes (dist::ReducerOptions::last_bucket_bytes); 0: none.
  int64_t last_bucket_bytes = 0;
  // With replicated updates (Note [Replicated updates]): how the replicas'
  // gradients are summed (data_parallel/in_process_hooks.h; Auto: exchanged and added
  // in the optimizer's update over two GPUs with peer access, else NCCL's
  // all-reduce) ...
  dist::GradSumMethod grad_sum = dist::GradSumMethod::Auto;
  // ... whether gradients of at least in_place_min_bytes are summed where the
  // backward wrote them, smaller ones packed first (Note [Gradients summed
  // where they are] in data_parallel/reducer.h), or every one packed. Negative
  // in_place_min_bytes: ValueError.
  bool grads_in_place = true;
  int64_t in_place_min_bytes = int64_t{1} << 20;
  // A communication hook of the user's own (data_parallel/comm_hook.h), which replaces
  // the strategy above: srcs[r] is replica r's flat buffer. With replicated
  // updates it must all_reduces() (ValueError otherwise).
  std::shared_ptr<dist::CommHook> comm_hook;
};

// The loss of one replica's chunk: its output and its share of the targets,
// on the replica's device, to a tensor of one element.
using ReplicaLossFn = std::function<Tensor(const nn::Value& output, const nn::Value& target)>;

// How a ReplicaLossFn reduces its chunk: Mean (e.g. cross_entropy's default)
// weights each replica's loss by its share of the batch, so that the losses
// sum to the loss of the whole batch; Sum adds them as they are.
enum class LossReduction { Mean, Sum };

// What DataParallel::forward_loss returns (Note [Per-replica losses]).
struct ReplicaLosses {
  std::vector<Tensor> losses;       // [replica], on its device, already weighted
  std::vector<nn::Value> outputs;   // [replica], on its device
  int64_t dim = 0;                  // the batch dimension, for output()
  Device output_device = cpu_device(0);

  // One backward pass from every replica's loss at once: each replica's
  // backward starts on its own device as soon as its loss is computed.
  void backward(bool retain_graph = false) const;
  // The loss of the whole batch on the output device (differentiable: its
  // backward is correct too, but waits for every replica's forward).
  Tensor loss() const;
  // The outputs gathered on the output device, as DataParallel::forward does.
  nn::Value output() const;

  // Note [Losses gathered beside the backward]: loss() and output() for
  // reporting (no gradient), issued right after the forward on a second
  // stream of the output device (gather_stream, set by forward_loss for a
  // GPU), so that the backward goes on while they travel.
  struct Gathered {
    Tensor loss;
    nn::Value output;
    // Makes the output device's current stream wait for the gather; call it
    // before reading loss or output there, and before a CUDA graph's capture
    // ends (after the step: it then costs nothing).
    void join() const;

    Device device = cpu_device(0);
    std::optional<Event> done;  // on the gather stream; none when gathered in place
  };
  Gathered gather_beside() const;
  std::optional<Stream> gather_stream;
};

// What an optimizer needs to keep the replicas updated itself (Note
// [Replicated updates]): pass both to optim::Optimizer::add_replicas.
struct ReplicatedUpdates {
  std::vector<std::pair<size_t, Tensor>> copies;  // {index in the optimizer's list, replica's copy}
  std::function<void()> after_step;
};

class DataParallel : public nn::Module {
 public:
  // Throws ValueError for an empty device list, a repeated device, a module
  // whose parameters are not all on the first device, or a negative bucket size.
  DataParallel(nn::ModulePtr module, std::vector<Device> devices, DataParallelOptions options = {});
  ~DataParallel() override;

  // Single tensor in, single tensor out (gathered on the output device).
  Tensor forward(const Tensor& x) override;
  // Nested inputs; with gather_output=false the result is a list with one
  // output per replica used.
  nn::Value forward_value(const nn::Value& x) override;

  // Note [Per-replica losses]: forward, then `loss_fn` on each replica's output
  // and its chunk of `target` (split like the input), in the replica's own
  // thread and on its device. Nothing is gathered: `backward()` on the result
  // starts every replica's backward at once.
  //   auto r = dp->forward_loss(x, y, [](const nn::Value& out, const nn::Value& t) {
  //     return nn::functional::cross_entropy(out.tensor(), t.tensor()); });
  //   opt.zero_grad(); r.backward(); opt.step();   // r.loss(): the batch's loss
  // `loss_fn` runs on every replica's thread at once: it must be safe to call
  // concurrently (a lambda over its arguments is). ValueError: a target whose
  // batch differs from the input's, a loss that is not one element or not on
  // its replica's device; what loss_fn throws comes back as an Error naming
  // the replica's device.
  ReplicaLosses forward_loss(const nn::Value& x, const nn::Value& target, const ReplicaLossFn& loss_fn,
                             LossReduction reduction = LossReduction::Mean);

  const nn::ModulePtr& module() const { return module_; }
  const std::vector<Device>& devices() const { return devices_; }
  // The replica on devices()[i] (0 is module()).
  nn::ModulePtr replica(size_t i) const { return replicas_.at(i); }

  // Note [Replicated updates]: for an optimizer over `params` (its params(),
  // all or some of module()'s parameters), the replicas' copies of them; from
  // now on gradients are all-reduced (every replica keeps the sum) instead of
  // summed on the first device, and the weights are not broadcast after an
  // update the optimizer made on every replica. One line:
  //   auto u = dp->replicate_updates(opt.params()); opt.add_replicas(u.copies, u.after_step);
  // ValueError for a tensor that is not a parameter of module().
  ReplicatedUpdates replicate_updates(const std::vector<Tensor>& params);
  bool replicated_updates() const { return replicated_; }

 protected:
  std::shared_ptr<nn::Module> make_empty() const override;

 private:
  struct Entry;  // one master parameter or buffer and its slots in each replica
  // The batch's split over the replicas: as-equal-as-possible chunks.
  struct Split {
    int64_t batch = 0;
    std::vector<int64_t> starts, lens;  // [replica used]
  };
  Split split_batch(const nn::Value& x) const;
  // Steps 1-3 of Note [DataParallel replicas]; `then(r, out)`, if given, runs
  // in replica r's thread after its forward.
  std::vector<nn::Value> run_replicas(const nn::Value& x, const Split& split,
                                      const std::function<void(size_t, const nn::Value&)>& then);
  void sync_replicas(size_t used);
  // Records the gradient nodes of replicas [0, used) and puts their recorded
  // parameter views in the replicas' slots (replica 0's until restore_masters).
  void record_gradient_nodes(size_t used);
  void restore_masters();
  // Note [Replicated updates]: a replica's stepped parameter has a gradient
  // only while its master has one. A master zeroed other than through the
  // optimizer (Module::zero_grad on the wrapped module) leaves its replicas'
  // gradients of the step before: dropped here, at the next forward, so that
  // no replica steps with a stale gradient; so are those of the replicas this
  // forward (over `used` replicas) leaves out, which would miss its share of
  // an accumulated gradient (the optimizer then copies the master to them).
  void drop_stale_replica_grads(size_t used);
  void wire_sync_batch_norm();
  // The optimizer's after_step (Note [Replicated updates]).
  void note_replicated_step();

  nn::ModulePtr module_;
  std::vector<Device> devices_;
  DataParallelOptions options_;
  std::vector<nn::ModulePtr> replicas_;
  std::vector<Entry> entries_;                  // parameters first, then buffers
  size_t num_params_ = 0;
  std::shared_ptr<const dist::FlatLayout> layout_;       // of every entry
  std::vector<Tensor> staging_;                            // [group] on devices_[0]
  std::vector<Tensor> staging_views_;                      // [entry] views into staging_
  std::vector<std::vector<Tensor>> flat_;                  // [replica][group] (replica 0: none)
  std::vector<std::vector<Tensor>> views_;                 // [replica][entry] views into flat_
  std::vector<size_t> grad_entries_;                       // the entries reducer_ covers
  std::unique_ptr<dist::Reducer> reducer_;                 // of their gradients
  std::unique_ptr<DeviceThreads> threads_;
  // One per SyncBatchNorm layer, its replicas as members (Note [DataParallel
  // and SyncBatchNorm]).
  std::vector<std::shared_ptr<dist::ReplicaStatsGroup>> stats_groups_;
  std::optional<Stream> gather_stream_;  // Note [Losses gathered beside the backward], made on first use
  bool grad_enabled_outside_ = true;
  // Note [Replicated updates]: whether the replicas get their own gradients
  // and are stepped by the optimizer, and which parameter entries it steps.
  bool replicated_ = false;
  std::vector<char> stepped_;                 // [entry]
  std::shared_ptr<DataParallel*> self_;       // for the optimizer's callback, reset when this goes
};


// Note [DataParallel replicas]: replicas are built once, at construction; the
// wrapped module itself is the replica on the first device. Each forward:
//  1. replicas whose copy is stale (a master parameter or buffer changed: the
//     optimizer or a batch-norm update bumped its version) receive the
//     master's values — users never call syncParameters;
//  2. every tensor of the input (a tensor or nested lists/maps) is split along
//     `dim` into as-equal-as-possible chunks, one per replica (fewer replicas
//     when the batch is smaller than the device count);
//  3. each replica runs forward on its own host thread (DeviceThreads), under
//     the caller's grad mode and autocast;
//  4. outputs are concatenated on the output device, or returned per replica.
//
// Note [Per-replica losses]: with forward()'s gathered output the loss is
// computed on the first device, so every step has two joins on the critical
// path: the first device waits for every replica's output (copied to it), and
// every replica's backward waits for the loss's gradient scattered back: gaps
// on each GPU, every step (docs/benchmarks.md).
// forward_loss computes each replica's loss beside its forward, in its own
// thread and on its device, weighted by its share of the batch (Mean), and
// ReplicaLosses::backward seeds them all in one pass (Note [Several roots] in
// autograd/engine.h): each device's backward starts when its own forward ends.
// The batch's loss and outputs are gathered only when asked for (loss(),
// output()), or beside the backward (gather_beside: Note [Losses gathered
// beside the backward] in data_parallel.cpp), no longer between the forward
// and the backward. Like
// the gradients, the losses are the whole batch's up to rounding: the chunks'
// means weighted by their shares instead of one mean.
//
// Note [DataParallel flat buffers]: the per-tensor host work is what limits
// scaling (a ResNet has ~100 parameters; one cross-device copy, event and
// graph node each, per replica, per step, all issued from one thread), so
// parameters and gradients move as flat buffers, one collective each
// (ops/comm.h: NCCL on GPUs):
//  - Each replica r >= 1 keeps one flat buffer per dtype on devices[r]; its
//    parameter and buffer slots are views into it. The master values are
//    packed into a staging buffer on devices[0] (one ops::copy_multi per
//    dtype: a few kernel launches, not one per tensor) and
//    broadcast_coalesced to every used replica: one collective per dtype.
//  - Gradients are summed by the shared gradient reducer (data_parallel/reducer.h,
//    Note [Gradient buckets] and Note [Gradient nodes]) with an in-process
//    CommHook: one NCCL reduce per bucket and dtype on GPUs, overlapping the
//    rest of the backward; the sums become the masters' .grad as views of
//    their bucket (no copy per parameter).
//  - A forward on one replica only (one device, or a batch of one) uses the
//    masters directly, as a plain module would: nothing to broadcast or sum.
// BatchNorm: each replica normalises with its own chunk's statistics; the
// running statistics of the first device's replica (the wrapped module) are the
// ones kept, and the other replicas receive them whenever they changed
// (PyTorch's behaviour). For the statistics of the whole batch, convert the
// model to SyncBatchNorm first (dist::convert_sync_batchnorm).
//
// Note [Replicated updates]: after each optimizer step the first device has
// new weights, and broadcasting them (pack, one NCCL broadcast per dtype) is
// on the critical path of the next step: every other device waits for the
// optimizer on the first one, then for the broadcast (a visible share of a
// small model's step; docs/benchmarks.md). With replicate_updates(), every
// replica keeps its weights and steps them itself, as each rank of DDP does:
//  - the gradient buckets are all-reduced (a dist::CommHook that
//    all_reduces(), chosen by DataParallelOptions::grad_sum: one NCCL
//    all-reduce per bucket and dtype, overlapping the backward), so each
//    replica holds the same sums; the join node makes every device's current
//    stream wait for them and gives each replica's copy of a stepped
//    parameter its .grad as a view of its own bucket (no copy); over two GPUs
//    (by default) the buckets are exchanged instead, and the optimizer's
//    update adds the two halves (Note [Gradient sums in the update] in
//    data_parallel/reducer.h);
//  - the optimizer, given the replicas' copies (optim::Optimizer::add_replicas,
//    Note [Optimizer replicas]), updates them in the same step() with their own
//    state -- one fused launch per device -- so with identical sums (an
//    all-reduce gives every device the same bits) the weights stay bit-equal;
//  - its after_step callback tells this DataParallel that the copies moved
//    with their masters: the next forward finds them in sync and broadcasts
//    nothing. A master changed any other way (a checkpoint loaded, a
//    parameter the optimizer does not hold) is still caught by its version
//    and broadcast, as without replicated updates.
// Buffers (batch norm's running statistics) are not broadcast while every
// module trains: a replica normalises with its chunk's statistics then, and
// only the first replica's running statistics are kept (as without). In eval
// mode, or with any module in eval mode, stale buffers are broadcast as before.
//
// Note [DataParallel and SyncBatchNorm]: at construction every SyncBatchNorm
// layer of the wrapped module gets a dist::ReplicaStatsGroup whose members are
// that layer's copies in the replicas (member r on devices[r]) and whose
// `across` is the layer's process group, if any: its statistics are summed
// over the replicas, then all-reduced across processes, once per layer.
// Each forward tells the groups how many replicas take part; a replica that
// fails aborts them, so the others, waiting at a layer's sum, fail too
// instead of waiting for it.

}  // namespace chorus::parallel
