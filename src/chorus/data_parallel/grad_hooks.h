// HookReducer: the gradient reducer's front end for one replica per process
// (DistributedDataParallel) over the reducer's engine (BucketEngine, Note [One
// reducer engine] in data_parallel/bucket_engine.h): each parameter's gradient
// is marked ready as soon as it is final (a post-accumulate hook), and a
// bucket goes to its CommHook (a ProcessGroup all-reduce, a compression hook,
// a user's own) once it is complete and its turn, while the backward still
// runs. The graph form (data_parallel/reducer.h, Note [Gradient nodes]) is
// DataParallel's front end over the same engine; DDP only plugs in a hook.
//
// Note [Reducer hooks]: one
// replica per process, whose parameters (all on one device) get a
// post-accumulate hook each (Tensor::register_post_accumulate_hook: called
// once a parameter's gradient of this backward is final). The bucket buffers
// are persistent. An armed backward (prepare_for_backward) goes:
//  1. each hook copies its parameter's .grad into the parameter's segment of
//     its bucket -- unless .grad already is that segment (the previous
//     reduction left it there and this backward accumulated into it in
//     place: no copy in the steady state of gradient accumulation);
//  2. once every parameter of a bucket is ready, and every earlier bucket has
//     been launched (every process must issue its collectives in one order,
//     or they pair up wrongly), an event is recorded on the device's current
//     stream and the bucket's buffers go to CommHook::reduce;
//  3. after the last bucket, join(device), and each parameter's .grad becomes
//     the view of its segment of the result (the bucket itself when reduce()
//     works in place, as an all-reduce does).
// A backward that is not armed (DDP's no_sync()) reduces nothing: gradients
// accumulate in .grad as for a plain module, and the next armed backward
// reduces the accumulated sum. Parameters that this backward will not reach
// (unused) are named to prepare_for_backward (ready at once), or left for
// flush() after the backward (ready then, so the buckets after theirs launch
// only at the end); they contribute the .grad they already hold (from
// unarmed backwards) or zeros. One that held a .grad gets the reduced
// result; one that did not keeps no .grad (whether some other rank used it,
// and so whether to take reduced_grad(k), is the caller's to agree on). The
// parameters may live on several devices (a model-parallel module): each
// bucket holds one device's, and finish joins every device. The
// first armed backward records the order in which gradients became ready;
// rebuild_buckets() re-plans the buckets in that order. The hooks hold the
// reducer's state weakly: a destroyed reducer leaves inert hooks behind.
#pragma once

#include <memory>
#include <vector>

#include "chorus/data_parallel/reducer.h"

namespace chorus::dist {

class HookReducer {
 public:
  // params: distinct leaves that require grad (on any devices).
  HookReducer(std::vector<Tensor> params, std::shared_ptr<CommHook> comm, ReducerOptions options = {});
  ~HookReducer();
  HookReducer(const HookReducer&) = delete;
  HookReducer& operator=(const HookReducer&) = delete;

  // Arms the next backward; `unused`: indices of parameters it will not reach.
  // Throws ValueError while an armed backward has not finished.
  void prepare_for_backward(const std::vector<size_t>& unused = {});
  // Marks every parameter the armed backward did not reach as unused, which
  // completes its reduction (no-op when not armed).
  void flush();
  // Disarms after a failed backward (waits for what was launched).
  void abandon();
  // Whether the armed backward's reduction is complete (grads are views).
  bool finished() const;
  // The parameters the last armed backward treated as unused.
  std::vector<size_t> unused() const;
  // Parameter k's reduced gradient (a view of its bucket), once finished.
  Tensor reduced_grad(size_t k) const;

  // The order in which gradients became ready in the first armed backward
  // (complete once it finished; empty before).
  std::vector<size_t> ready_order() const;
  // Re-plans the buckets from ready_order() (Note [Gradient buckets]); only
  // between backwards. Gradients that are views of the old buckets are left
  // as they are (copied in, not reused, by the next backward).
  void rebuild_buckets();
  // The same from an explicit order (another rank's ready_order(), so that
  // every rank plans the same buckets); ValueError if it is not a permutation.
  void rebuild_buckets_from(const std::vector<size_t>& order);

  const GradBuckets& buckets() const;
  // Host seconds spent so far waiting in the hook's join() for the
  // reductions (the time this rank waited for the others' gradients; Note
  // [Slow ranks named]).
  double join_seconds() const;
  // Bucket b's flat buffers, one per dtype group (tests, and DDP's own use).
  std::vector<Tensor> bucket_buffers(size_t b) const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace chorus::dist
