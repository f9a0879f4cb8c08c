#include "chorus/data_parallel/ddp.h"

#include <algorithm>
#include <chrono>
#include <atomic>
#include <map>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "chorus/autograd/backward_observer.h"
#include "chorus/autograd/grad_mode.h"
#include "chorus/core/error.h"
#include "chorus/data_parallel/flat_layout.h"
#include "chorus/data_parallel/grad_hooks.h"
#include "chorus/data_parallel/replica_sync.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/factory.h"
#include "chorus/ops/profile.h"

namespace chorus::dist {

namespace {

std::atomic<int> next_instance{0};

}  // namespace

struct DistributedDataParallel::Impl final : autograd::BackwardObserver {
  ProcessGroupPtr group;
  DDPOptions options;
  std::vector<std::string> names;  // [k]
  std::vector<Tensor> params;      // [k]
  std::unordered_map<const TensorImpl*, size_t> index;
  std::unique_ptr<HookReducer> reducer;
  std::unique_ptr<FlatSet> buffers;

  std::mutex mu;
  bool no_sync = false;
  bool arm_next = false;     // the next backward over these parameters reduces
  bool in_backward = false;  // an armed backward is running
  PassStack passes;        // Note [Nested backward passes] (replica_sync.h)
  size_t armed_depth = 0;  // the depth of the pass that reduces
  bool order_synced = false;  // the buckets were re-planned from rank 0's order
  int64_t reduced_steps = 0;
  double wait_seconds = 0;  // in end(); with reducer->join_seconds(), gradient_wait_seconds()
  Tensor used_flags;         // [k] on the group's device: the ranks' used-flags, summed
  Tensor all_used;           // [k] ones on the group's device: the flags of a step that used everything
  WorkPtr used_work;
  std::vector<int64_t> used;  // [k] this rank's flags for the running backward
  std::vector<std::string> unused_names;

  // Caller holds mu.
  void broadcast_buffers(nn::Module& module) {
    if (!buffers) return;
    NoGradGuard no_grad;
    broadcast_module_buffers(*buffers, *group, module);
  }

  void rebuild_from_rank0_order() {
    std::vector<size_t> order = reducer->ready_order();
    std::vector<int64_t> as_int(order.begin(), order.end());
    Tensor t = ops::to_device(from_vector(as_int, {static_cast<int64_t>(as_int.size())}), group->device());
    group->broadcast(t, 0)->wait();
    std::vector<int64_t> root = t.to_vector<int64_t>();
    // Rank 0's order, so that every rank plans the same buckets. Check the
    // permutation ourselves: a different order is fine, a different set is a bug.
    reducer->rebuild_buckets_from(std::vector<size_t>(root.begin(), root.end()));
  }

  void begin(const std::unordered_set<const TensorImpl*>& leaves) override {
    std::lock_guard<std::mutex> lk(mu);
    // Someone else's backward, or not armed (no_sync).
    if (!passes.push(leaves, params) || !arm_next) return;
    arm_next = false;
    in_backward = true;
    armed_depth = passes.depth();
    reducer->prepare_for_backward(unreached_params(leaves, params, used));
  }

  // Note [DDP unused parameters]: the used-flags travel after the last
  // bucket, so they add no meeting point between the ranks in mid-step. The
  // caller's stream waits for them at once (behind the last bucket, which it
  // waits for anyway): no collective outlives its step, so a step captured as
  // a CUDA graph is whole, and never waits for one issued before the capture.
  void exchange_used_flags() {
    if (group->size() == 1) return;
    const int64_t n = static_cast<int64_t>(params.size());
    const bool everything = std::all_of(used.begin(), used.end(), [](int64_t u) { return u != 0; });
    if (everything && !all_used.defined()) all_used = ones({n}, TensorOptions(kInt64, group->device()));
    // The usual step copies on the device: no host-to-device transfer.
    used_flags = everything ? ops::clone(all_used) : ops::to_device(from_vector(used, {n}), group->device());
    used_work = group->all_reduce(used_flags, ReduceOp::Sum);
    used_work->wait();
  }

  void end(bool ok) override {
    std::lock_guard<std::mutex> lk(mu);
    // Note [Nested backward passes]: a recomputed block's inner pass ends first.
    const PassStack::Ended e = passes.pop();
    if (!e.ours || !in_backward || e.depth != armed_depth) return;
    in_backward = false;
    if (!ok) {
      reducer->abandon();
      return;
    }
    {
      // The host's wait for the last buckets' all-reduces (Note [Step traces]).
      ops::TraceScope wait("wait_gradients");
      const auto begin = std::chrono::steady_clock::now();
      reducer->flush();
      CHORUS_ASSERT(reducer->finished());
      exchange_used_flags();
      wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    }
    ++reduced_steps;
    unused_names.clear();
    std::vector<size_t> without_grad;
    for (size_t k : reducer->unused())
      if (!params[k].grad().defined()) without_grad.push_back(k);
    if (without_grad.empty()) return;
    // Some parameter got nothing here: did another rank use it?
    std::vector<int64_t> counts(params.size(), 0);
    if (group->size() > 1) {
      used_work.reset();
      counts = used_flags.to_vector<int64_t>();
    }
    for (size_t k : without_grad) {
      if (counts[k] > 0)
        params[k].set_grad(reducer->reduced_grad(k));
      else
        unused_names.push_back(names[k]);
    }
  }
};

DistributedDataParallel::DistributedDataParallel(nn::ModulePtr module, ProcessGroupPtr group, DDPOptions options)
    : nn::Module("DistributedDataParallel"), module_(std::move(module)), impl_(std::make_shared<Impl>()) {
  CHORUS_CHECK(module_ != nullptr, "DistributedDataParallel: module is null");
  CHORUS_CHECK(group != nullptr, "DistributedDataParallel: the process group is null");
  CHORUS_CHECK(options.bucket_bytes >= 0 && options.first_bucket_bytes >= 0 && options.last_bucket_bytes >= 0,
               "DistributedDataParallel: bucket sizes must be >= 0, got bucket_bytes ", options.bucket_bytes,
               ", first_bucket_bytes ", options.first_bucket_bytes, " and last_bucket_bytes ",
               options.last_bucket_bytes);
  register_child("", module_);  // no name: state_dict keys stay the module's own (Note [State dict names])
  Impl& s = *impl_;
  s.group = std::move(group);
  s.options = options;
  const int instance = next_instance.fetch_add(1);

  ReplicaParameters rp = check_replica(*module_, *s.group, "DistributedDataParallel",
                                       "ddp/" + std::to_string(instance), /*group_device_only=*/false);
  s.names = rp.names;
  s.params = rp.trainable;
  for (size_t k = 0; k < s.params.size(); ++k) s.index[s.params[k].impl()] = k;

  NoGradGuard no_grad;
  if (s.group->size() > 1) {
    std::vector<Tensor> all = rp.trainable;
    all.insert(all.end(), rp.frozen.begin(), rp.frozen.end());
    broadcast_in_place(*s.group, all);
  }
  // Note [DDP buffers]: the slots hold views of the flat buffers from now on.
  s.buffers = flatten_module_buffers(*module_);
  if (s.buffers) broadcast_module_buffers(*s.buffers, *s.group, *module_);
  std::shared_ptr<CommHook> hook = options.hook ? options.hook : make_comm_hook(options.comm_hook, s.group, options.average);
  s.reducer = std::make_unique<HookReducer>(
      s.params, std::move(hook),
      ReducerOptions{options.bucket_bytes, options.first_bucket_bytes, options.last_bucket_bytes});
  observer_handle_ = autograd::add_backward_observer(impl_);
}

DistributedDataParallel::~DistributedDataParallel() = default;

Tensor DistributedDataParallel::forward(const Tensor& x) { return forward_value(nn::Value(x)).tensor(); }

nn::Value DistributedDataParallel::forward_value(const nn::Value& x) {
  Impl& s = *impl_;
  {
    std::lock_guard<std::mutex> lk(s.mu);
    CHORUS_CHECK(!s.in_backward, "DistributedDataParallel: forward while a backward is running");
    if (s.options.broadcast_buffers && is_training()) s.broadcast_buffers(*module_);
    const bool will_reduce = grad_enabled() && is_training() && !s.no_sync;
    if (will_reduce && s.options.rebuild_buckets && !s.order_synced && s.reduced_steps > 0) {
      s.rebuild_from_rank0_order();
      s.order_synced = true;
    }
    s.arm_next = will_reduce;
  }
  return module_->forward_value(x);
}

void DistributedDataParallel::broadcast_buffers() {
  std::lock_guard<std::mutex> lk(impl_->mu);
  impl_->broadcast_buffers(*module_);
}

DistributedDataParallel::NoSync DistributedDataParallel::no_sync() { return NoSync(impl_, impl_->mu, impl_->no_sync); }

const ProcessGroupPtr& DistributedDataParallel::process_group() const { return impl_->group; }
const DDPOptions& DistributedDataParallel::options() const { return impl_->options; }
const GradBuckets& DistributedDataParallel::buckets() const { return impl_->reducer->buckets(); }

double DistributedDataParallel::gradient_wait_seconds() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->wait_seconds + impl_->reducer->join_seconds();
}

std::vector<std::string> DistributedDataParallel::unused_parameters() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->unused_names;
}

std::shared_ptr<nn::Module> DistributedDataParallel::make_empty() const {
  CHORUS_THROW(ValueError, "DistributedDataParallel cannot be cloned; clone its module() instead");
}

}  // namespace chorus::dist
