// ShardedDataParallel: data parallelism with the training state sharded over
// the ranks (ZeRO stages 1, 2 and 3; PyTorch's FSDP, DeepSpeed's ZeRO).
//
//   auto pg = dist::init_process_group();
//   auto sdp = std::make_shared<dist::ShardedDataParallel>(model, pg, dist::ShardOptions{.stage = 3});
//   optim::AdamW opt(sdp->shard_parameters(), {...});   // this rank's pieces, not the model's parameters
//   Tensor loss = cross_entropy(sdp->forward(x), y);     // x: this rank's share of the batch
//   opt.zero_grad(); loss.backward(); sdp->clip_grad_norm(1.0); opt.step();
//
// Every trainable parameter's elements are laid out in flat buffers (the
// gradient reducer's bucket plan, GradBuckets: Note [Gradient buckets]), and
// each rank owns one contiguous 1/N of every buffer: its *shard*. The
// optimizer sees only the pieces of the parameters that fall in this rank's
// shards (shard_parameters(): 1-d views, one per parameter that has elements
// here), so its state -- AdamW's two moments -- is 1/N of the model's.
//  - stage 1: the gradients are reduce-scattered (each rank gets the average
//    of its shard only) in place in full-size gradient buffers that persist;
//    after the optimizer step the next forward all-gathers the updated shards;
//  - stage 2: the same, but the full-size gradient buffer of a bucket lives
//    only from the moment its last gradient is ready until its
//    reduce-scatter is issued: gradients are kept as shards only;
//  - stage 3: the weights are sharded too. The module is cut into *units*
//    (ShardOptions::units, by default the repeated blocks: Note [Sharded
//    units]), each one bucket; a unit's weights are all-gathered just before
//    its forward (the next unit's gather issued at once, so it travels while
//    this one computes), freed after it (reshard_after_forward), gathered
//    again just before its backward, and freed once its gradients are
//    reduce-scattered. Outside a unit's forward or backward only the shards
//    exist: no second full copy of the model anywhere.
// After a synced backward the module's own parameters hold no .grad (the
// reduced gradients are the shard pieces' .grad). The notes after the class
// say how each part works.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "chorus/data_parallel/grad_buckets.h"
#include "chorus/distributed/process_group.h"
#include "chorus/data_parallel/replica_sync.h"
#include "chorus/nn/module.h"
#include "chorus/ops/global_norm.h"

namespace chorus::dist {

struct ShardOptions {
  int stage = 1;  // 1, 2 or 3 (ValueError otherwise)
  // Stages 1 and 2: the gradient buckets (Note [Gradient buckets]); each
  // bucket's reduce-scatter is issued as soon as its gradients are ready.
  int64_t bucket_bytes = int64_t{25} << 20;
  // Stage 3: the modules (inside the wrapped one) sharded as units; empty:
  // found as Note [Sharded units] says. Parameters in no unit form the root
  // unit, gathered for the whole step. Units given here are sharded from
  // construction (as FSDP2's fully_shard on each block): at stage 3 every
  // rank's forward must run each of them through its parent's children, in
  // every step.
  // Stages 1-2: each unit's forward waits only for the buckets that hold its
  // own weights, so the rest travel beside the units before it (Note
  // [Gathers beside the forward]); a unit skipped or called past its
  // wrapper in the first step is waited for at the forward's start instead;
  // empty: the module's forward waits for every bucket before it starts.
  std::vector<nn::ModulePtr> units;
  // Stage 3: free a unit's gathered weights after its forward (and gather them
  // again for its backward); false keeps them from the forward to the end of
  // the unit's backward (less communication, more memory).
  bool reshard_after_forward = true;
  // Stage 3: issue the next unit's gather before this unit computes.
  // Stages 1-2 with units: false waits for every bucket's gather at the
  // module's forward, as with no units.
  bool prefetch = true;
  // Mixed precision (FSDP's param_dtype): the dtype the module's parameters
  // hold while gathered -- bfloat16 halves the gathers and the full-size
  // weights and gradients -- while the shards the optimizer updates stay in
  // the parameters' own dtype (float32 masters). Applies to the parameters
  // `param_dtype_for` accepts (by name and tensor; null: every floating
  // trainable parameter), e.g. only the matrices that autocast would cast,
  // so norms and embeddings compute as before. Their gradients arrive in
  // this dtype and are reduced in it unless reduce_dtype says otherwise;
  // the optimizer's gradient shards are in the masters' dtype. A forward
  // must accept such parameters: run it under autocast to this dtype.
  std::optional<DType> param_dtype;
  std::function<bool(const std::string& name, const Tensor& param)> param_dtype_for;
  // The dtype gradients travel in (bfloat16 halves the traffic; each
  // rank's average is taken back in the masters' dtype); nullopt: the
  // gradients' own (param_dtype's, for the parameters it applies to).
  std::optional<DType> reduce_dtype;
  bool average = true;            // false: gradients summed over the ranks
  bool broadcast_buffers = true;  // rank 0's buffers to every rank before each forward
  // Hybrid sharding: the state is sharded over `group` (the GPUs of one node)
  // and replicated over this one (the same shard index on the other nodes):
  // each shard's gradient is averaged over it after the reduce-scatter.
  ProcessGroupPtr replicate_group;
};

class ShardedDataParallel : public nn::Module {
 public:
  // Checks that every rank holds the same model (Note [DDP model check]),
  // broadcasts rank 0's parameters and buffers, lays the trainable
  // parameters out in the flat buffers and keeps this rank's shards (stage
  // 3: frees the rest). A collective: every rank of `group` constructs it.
  // ValueError for a stage other than 1-3, a parameter that is not
  // contiguous, or parameters on a device the group cannot reduce.
  ShardedDataParallel(nn::ModulePtr module, ProcessGroupPtr group, ShardOptions options = {});
  ~ShardedDataParallel() override;

  Tensor forward(const Tensor& x) override;
  nn::Value forward_value(const nn::Value& x) override;

  // What the optimizer updates: one 1-d leaf per trainable parameter that has
  // elements in this rank's shards (a view of the master shard), in the
  // module's parameter order. After each synced backward its .grad is the
  // ranks' average for those elements (none when no rank used the parameter).
  const std::vector<Tensor>& shard_parameters() const;
  // One per shard parameter: which of the module's parameters it is a piece
  // of, and where.
  struct Piece {
    std::string name;   // the module's parameter name
    size_t param = 0;   // its index among the trainable parameters (module order)
    Shape shape;        // the parameter's full shape
    DType dtype = kFloat32;  // the master's (the parameter's before wrapping)
    int64_t begin = 0, end = 0;  // elements [begin, end) of its row-major flattening
  };
  const std::vector<Piece>& pieces() const;
  // The trainable parameters' names (module order): Piece::param indexes them.
  const std::vector<std::string>& parameter_names() const;

  // Clips the gradients by the global 2-norm over every rank's shards
  // (torch's clip_grad_norm_ on the whole model); returns the norm before
  // clipping (a collective; on the device, float32, or float64 for a float64
  // model). max_norm <= 0: the norm only.
  Tensor clip_grad_norm(double max_norm);
  // clip_grad_norm with the gradients left as they are: the same norm, and
  // the scale min(1, max_norm / (norm + 1e-6)) for Optimizer::step_scaled to
  // apply as it reads them (Note [Clipping in the update] in
  // optim/clip_grad.h) -- one pass over the shards' gradients fewer, which
  // chorus train's and bench's ZeRO steps take. The scale is undefined when
  // max_norm <= 0 or infinite. A collective.
  ops::NormAndScale clip_grad_norm_scale(double max_norm);

  // The full weights in the module's parameters now (a collective): after an
  // optimizer step, before evaluating through the module itself. At stage 3
  // they stay gathered until the next training forward. Under param_dtype
  // they are in that dtype: export full_parameters() instead.
  void gather_parameters();
  // Every trainable parameter whole, in its masters' dtype, on the host
  // (a collective, one bucket at a time): for exporting the model.
  NamedTensors full_parameters();

  // Writes `values(piece)` (a 1-d tensor of the piece's elements) into every
  // shard parameter: loading a checkpoint written at any layout. The next
  // forward gathers the new weights.
  void load_shards(const std::function<Tensor(const Piece&)>& values);

  // While the guard lives, backwards reduce nothing: gradients accumulate in
  // the module's parameters (full size), and the next synced backward reduces
  // the sum.
  using NoSync = NoSyncGuard;
  [[nodiscard]] NoSync no_sync();

  const nn::ModulePtr& module() const { return module_; }
  const ProcessGroupPtr& process_group() const;
  const ShardOptions& options() const;
  // The flat layout: buckets (stage 3: one per unit, the last unit first --
  // the backward's order -- and the root unit last).
  const GradBuckets& buckets() const;
  // Stage 3: the units' module names ("" for the root unit), bucket order.
  std::vector<std::string> unit_names() const;
  // Parameters no rank used in the last synced step.
  std::vector<std::string> unused_parameters() const;
  // Bytes this rank holds now in weights (full and shards), gradients and
  // communication buffers, on the parameters' device (the memory plan's
  // check; optimizer state is the optimizer's).
  // peak_full_grads: the most full-size gradient bytes held at once since
  // construction (stages 2-3 promise the buffers of about two buckets:
  // the one being reduce-scattered and the one before it); largest_bucket_grads:
  // the largest bucket's full-size gradient bytes, to compare with.
  // shard_grads: the gradient shards held apart from the full buffers (Note
  // [Sharded gradient shards]): from the reduce-scatters to the optimizer's
  // zero_grad(), none between steps once that has dropped the pieces'
  // gradients.
  struct Held {
    int64_t full_weights = 0, shard_weights = 0, full_grads = 0, shard_grads = 0;
    int64_t peak_full_grads = 0, largest_bucket_grads = 0;
  };
  Held held_bytes() const;

 protected:
  std::shared_ptr<nn::Module> make_empty() const override;

 private:
  struct Impl;
  class Unit;
  nn::ModulePtr module_;
  std::shared_ptr<Impl> impl_;
  std::shared_ptr<void> observer_handle_;
};

// Note [Sharded units]: with no units given, stage 3 takes as units the
// children of every module whose children holding parameters are at least
// two and all of one type -- the repeated blocks (a GPT's transformer
// blocks, a stack of Linear layers) -- found from the top, without looking
// inside a unit. Each unit's
// parameters are one bucket: one all-gather before its forward and one
// reduce-scatter after its backward. The unit module is replaced in its
// parent by a wrapper of the same name (state-dict names unchanged) that
// gathers, runs it, attaches the pre-backward gather to its output and frees.
// Units found this way are not trusted at once: the first synced step runs
// with every unit gathered (as from construction: the whole model's weights,
// as the module held them before it was wrapped) and only notes which
// wrappers ran; then one all-reduce keeps as sharded units those that ran on
// every rank. Units the caller names (ShardOptions::units: the trainer names
// a GPT's blocks) are sharded from construction, so that no step ever holds
// the whole model -- a model of 9.7B parameters could not hold it. A unit run on some steps or
// ranks only, or called by a parent through a pointer of its own rather than
// through its children (as Sequential, ModuleList and the GPT call them),
// would make the ranks' collectives differ: it is gathered with the root
// unit instead (one warning names it), so such a model trains correctly with
// less memory saved. A parameter two units
// share (a tied weight) belongs to the root unit.
//
// A unit recomputed in the backward (--recompute: its forward runs again
// just before its backward) neither prefetches the next unit nor frees its
// weights after that forward: its own backward needs them next, and the
// backward's pre-hook prefetches the unit before it.
//
// Note [Sharded gathers]: a bucket's weights are gathered when the forward
// that reads them starts (stages 1 and 2: every bucket whose shard changed
// since, at the start of the module's forward; stage 3: each unit's own),
// and the gathered parameters' version counters are bumped when the shard
// changed (autocast's kept 16-bit copies are then cast afresh). At stage 3
// the storage the parameters view is freed and allocated again (Note
// [Released storage] in core/storage.h): the autograd graph's saved
// references to the weights see the weights again when the backward gathers
// them. The order of the collectives is the same on every rank: the forward
// visits the units in one order, the backward's pre-hooks and
// gradient-ready hooks fire in the engine's order, and buckets launch their
// reduce-scatters in index order.
//
// Note [Gathers beside the forward]: after an optimizer step every bucket
// must be gathered again before the weights it holds are read. At stages 1-2
// the simple way -- the module's forward waits for every bucket, then
// computes -- leaves the whole model's all-gather (gpt2-xl's 3 GB of bfloat16
// weights: about 7 ms over 4 H200s) in front of the step with nothing beside
// it, which is what llm.c's ZeRO-1 does too. Given units (a GPT's blocks; the
// trainer names them at every stage) the forward issues every bucket's
// gather at once, on the communication stream, in the order it will reach
// them -- the buckets holding parameters of no unit (the embeddings, the
// final norm, a tied weight) first, then the others from the last bucket
// down, as the plan holds the parameters from the last to the first -- and
// waits only for the root's. Each unit, wrapped in its parent as at stage 3
// (the same wrapper; names unchanged), waits for the buckets holding its own
// weights just before its forward, so block i computes while the gathers of
// blocks i+1... travel. A bucket holds a slice of the parameter list, so one
// may serve two neighbouring units; the first waits for it. The root's
// buckets include the first one, which holds the final norm beside the last
// block's tail: that much of the last block is waited for up front. Units
// are trusted only once seen: the first synced step waits for every gather
// at the forward's start and notes whose wrappers ran; a unit whose wrapper
// did not (skipped that step, or called by its parent past the wrapper,
// where a lazy wait would let it read weights still arriving) is waited for
// at the start from then on -- each rank deciding for itself, since only
// waits change, not the gathers' order. Nothing is freed
// (stages 1-2 keep the full weights), the backward gathers nothing, and the
// collectives are issued in the same order on every rank. At the end of the
// forward every gather still in flight (a unit this forward skipped) is
// waited for, because its source is the shard as it was when it was issued.
//
// Note [Sharded gradients]: as DDP's reducer (Note [Reducer hooks]), each
// parameter's post-accumulate hook counts it ready; a bucket whose
// parameters are all ready, and whose predecessors have launched, copies the
// gradients into a zeroed full-size buffer (stage 1: persistent; 2 and 3:
// allocated now, dropped once the next bucket launches, after its
// reduce-scatter was ordered) and reduce-scatters it into this rank's shard
// gradient (Note [Sharded gradient shards]; added to what the pieces still
// hold: accumulation across synced steps). Unused parameters contribute
// zeros; the per-parameter used-flags are all-reduced after the last
// bucket, as DDP does (Note [DDP
// unused parameters]), so a parameter no rank used keeps no gradient and is
// skipped by the optimizer, as one process would.
//
// Note [Sharded gradient shards]: no gradient shard of its own persists
// across steps. Stage 1 reduce-scatters each bucket in place: the output is
// this rank's own segment of the full buffer, grad_full[rank * per, (rank +
// 1) * per) (NCCL's in-place form; Gloo reduces a copy of the input), so the
// shard the optimizer reads is that segment when the masters share its dtype
// (float32 or float64 throughout). When they do not (param_dtype's bfloat16
// matrices over float32 masters), the float32 shard is cast after the
// backward into the same buffer, over the other ranks' segments, which are
// spent once the reduce-scatter is done: per float32 elements need two
// bfloat16 segments beside this rank's own, so every rank of 4 or more finds
// room (shard_in_full; 2 ranks, and the middle rank of 3, do not). The
// 1.5B-parameter gpt2-xl on 4 ranks thus holds no 1.45 GiB float32 shard at
// all, eager or captured in a CUDA graph (where a fresh tensor would take
// graph-pool memory of its own: Note [Graph pools] in
// cuda/runtime/allocator.h reuses blocks only of the same size class).
// Where it does not fit (cast in finish()), and at stages 2-3 (whose full
// buffer does not outlive the bucket: they reduce into a [per] tensor of the
// masters' dtype made at the launch, in the backward, as the activations
// go), the shard is a tensor of its own that only the pieces' .grad (views
// of it) hold: the optimizer's zero_grad() after the step frees it before
// the next forward, where the activations peak. The trainers drop the
// gradients after each step (chorus train's GPT loop and bench) or before
// the forward (the image step), so the memory plan counts such a shard only
// past the activations (Note [Memory plan formulas]); inside a CUDA graph
// it takes graph-pool memory, as much as the persistent shard took before.
// A piece's gradient inside a full buffer is overwritten by the next
// launch: a second synced backward before zero_grad() (accumulation across
// synced steps) first gives such a piece a copy of its gradient, then adds
// the pieces' gradients to the new shard.
//
// Note [Sharded steps in a CUDA graph]: a whole training step under
// ShardedDataParallel can be captured (parallel::GraphedStep, as `chorus
// train` does) because the step's device work is the same every time once
// the units are decided: after each synced backward every shard is stale,
// so each forward gathers every bucket (stages 1-2: into the persistent full
// buffers; stage 3: unit by unit into storage reallocated from the graph's
// pool), the backward reduce-scatters every bucket in index order, and the
// used-flags of a step that used every parameter are all-reduced from a
// device tensor without a host read. The host bookkeeping (gathered, stale)
// is left as after a step, which is where every replay leaves the device: an
// eager forward between replays (an evaluation) gathers afresh. The other
// way round, weights still gathered when a capture begins (an evaluation's
// gather_parameters() between the eager steps and the captured one) are
// dropped first, so that the graph holds every gather: skipped, the replays
// would compute with those weights for good. What would
// change the work -- a parameter left unused (its flags are read on the
// host), the units not yet decided (auto-found units at stage 3: their first
// step) -- happens in the eager warm-up steps or makes the capture fail, and
// the step then stays eager (GraphedStep says so in one line).

}  // namespace chorus::dist
