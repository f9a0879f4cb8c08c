#include "chorus/data_parallel/grad_hooks.h"

#include <algorithm>
#include <mutex>

#include "chorus/autograd/side_work.h"
#include "chorus/data_parallel/bucket_engine.h"
#include "chorus/core/error.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/factory.h"
#include "chorus/ops/profile.h"

namespace chorus::dist {

// Note [Reducer hooks] (grad_hooks.h): the front end of one replica per
// process over the engine (Note [One reducer engine] in bucket_engine.h).
struct HookReducer::State {
  std::vector<Tensor> params;
  ReducerOptions options;
  std::vector<Device> devices;  // distinct, of the parameters

  mutable std::mutex mu;  // the hooks may run on several engine threads
  std::unique_ptr<BucketEngine> engine;
  std::vector<std::vector<Tensor>> buffers;  // [bucket][group], persistent
  std::vector<std::vector<Tensor>> results;  // [bucket][group]: the armed backward's reductions
  std::vector<Tensor> views;                 // [k]: its segment of its bucket's buffer
  bool armed = false, done = false;
  std::vector<char> unused;  // [k] in the armed backward
  std::vector<char> kept;    // [k] unused but with an earlier .grad, reduced too

  const GradBuckets& buckets() const { return engine->plan(); }

  std::shared_ptr<const GradBuckets> make_plan(const std::vector<size_t>& fill) const {
    return std::make_shared<const GradBuckets>(params, options.bucket_bytes, options.first_bucket_bytes, fill,
                                               options.last_bucket_bytes);
  }

  void plan(const std::vector<size_t>& fill) {
    engine->set_plan(make_plan(fill));
    make_buffers();
  }

  void make_buffers() {
    buffers.clear();
    views.assign(params.size(), Tensor());
    for (const GradBuckets::Bucket& b : buckets().buckets) {
      buffers.emplace_back();
      const Device d = params[b.ks[0]].device();
      for (size_t g = 0; g < b.layout.groups(); ++g)
        buffers.back().push_back(empty({b.layout.numels[g]}, TensorOptions(b.layout.dtypes[g], d)));
      for (size_t i = 0; i < b.ks.size(); ++i)
        views[b.ks[i]] = b.layout.view(buffers.back()[b.layout.segments[i].group], i);
    }
  }

  // Copies the .grad of bucket b's used parameters into their segments (one
  // ops::copy_multi), skipping those whose .grad already is the segment.
  void gather_into_bucket(size_t b) {
    TensorList srcs, dsts;
    for (size_t k : buckets().buckets[b].ks) {
      if (unused[k]) continue;  // mark_unused wrote its segment
      const Tensor g = params[k].grad();
      // Computed beside the data gradient, it is read from here on (Note
      // [Weight gradients beside the data gradient]).
      autograd::join_beside_for(g);
      const Tensor& dst = views[k];
      if (g.storage() == dst.storage() && g.storage_offset() == dst.storage_offset() && g.strides() == dst.strides())
        continue;
      srcs.push_back(g);
      dsts.push_back(dst);
    }
    if (!srcs.empty()) ops::copy_multi(srcs, dsts);
  }

  // Bucket b complete and its turn: into its buffers, then each buffer to the
  // CommHook after an event on the device's current stream.
  void launch(size_t b) {
    gather_into_bucket(b);
    Event written(params[buckets().buckets[b].ks[0]].device(), /*timing=*/false);
    written.record();
    for (size_t g = 0; g < buffers[b].size(); ++g) {
      std::vector<Tensor> one{buffers[b][g]};
      results[b][g] = engine->reduce(one, {written});
    }
  }

  // Caller holds mu.
  void mark_ready(size_t k) {
    engine->readiness().mark_ready(k, [this](size_t b) { launch(b); });
    if (engine->readiness().all_launched()) finish();
  }

  // Parameter k's segment of its bucket's reduced result.
  Tensor result_view(size_t k) const {
    const GradBuckets::Place pl = buckets().place(k);
    const Tensor& result = results[pl.bucket][pl.group];
    // The bucket itself when the comm works in place: the persistent view.
    const Tensor& buf = buffers[pl.bucket][pl.group];
    return result.storage() == buf.storage() && result.storage_offset() == buf.storage_offset() ? views[k]
                                                                                                : engine->view(k, result);
  }

  void finish() {
    engine->join(devices);
    for (size_t k = 0; k < params.size(); ++k)
      if (!unused[k] || kept[k]) params[k].set_grad(result_view(k));
    armed = false;
    done = true;
    engine->readiness().stop_recording();
  }

  // Caller holds mu. k contributes what it already holds (an earlier
  // unarmed backward's .grad) or nothing.
  void mark_unused(size_t k) {
    unused[k] = 1;
    const Tensor g = params[k].grad();
    Tensor dst = views[k];
    if (!g.defined()) {
      dst.zero_();
    } else {
      kept[k] = 1;
      if (g.storage() != dst.storage() || g.storage_offset() != dst.storage_offset() || g.strides() != dst.strides())
        ops::copy_(dst, g);
    }
  }

  void on_grad_ready(size_t k) {
    std::lock_guard<std::mutex> lk(mu);
    if (!armed) return;  // an unarmed backward (no_sync): a plain accumulation
    // The copy into the bucket waits for the bucket's launch: one multi-tensor
    // copy per bucket instead of a launch per parameter (host time is what a
    // fast GPU step is short of).
    mark_ready(k);
  }
};

HookReducer::HookReducer(std::vector<Tensor> params, std::shared_ptr<CommHook> comm, ReducerOptions options)
    : state_(std::make_shared<State>()) {
  State& s = *state_;
  CHORUS_CHECK(comm != nullptr, "HookReducer: the bucket communication is null");
  CHORUS_CHECK(options.bucket_bytes >= 0 && options.first_bucket_bytes >= 0 && options.last_bucket_bytes >= 0,
               "HookReducer: bucket sizes must be >= 0, got bucket_bytes ", options.bucket_bytes,
               ", first_bucket_bytes ", options.first_bucket_bytes, " and last_bucket_bytes ",
               options.last_bucket_bytes);
  CHORUS_CHECK(!params.empty(), "HookReducer: no parameters");
  for (size_t k = 0; k < params.size(); ++k) {
    const Tensor& p = params[k];
    CHORUS_CHECK(p.defined() && p.is_leaf() && p.requires_grad(), "HookReducer: parameter ", k,
                 " must be a leaf that requires grad");
    if (std::find(s.devices.begin(), s.devices.end(), p.device()) == s.devices.end()) s.devices.push_back(p.device());
    for (size_t j = 0; j < k; ++j)
      CHORUS_CHECK(params[j].impl() != p.impl(), "HookReducer: parameters ", j, " and ", k, " are the same tensor");
  }
  s.params = std::move(params);
  s.options = options;
  s.engine = std::make_unique<BucketEngine>(s.make_plan({}), std::move(comm), BucketReadiness::Order::InOrder);
  s.make_buffers();
  std::weak_ptr<State> weak = state_;
  for (size_t k = 0; k < s.params.size(); ++k)
    s.params[k].register_post_accumulate_hook(
        [weak, k](Tensor&) {
          if (auto st = weak.lock()) st->on_grad_ready(k);
        },
        /*reads_grad=*/false);  // gather_into_bucket reads it
}

HookReducer::~HookReducer() = default;

void HookReducer::prepare_for_backward(const std::vector<size_t>& unused) {
  State& s = *state_;
  std::lock_guard<std::mutex> lk(s.mu);
  CHORUS_CHECK(!s.armed, "HookReducer: prepare_for_backward while the previous armed backward has not finished (",
               "a parameter it reached no gradient for must be named unused)");
  const size_t n = s.params.size();
  s.unused.assign(n, 0);
  s.kept.assign(n, 0);
  s.results.assign(s.buffers.size(), {});
  for (size_t b = 0; b < s.buffers.size(); ++b) s.results[b].resize(s.buffers[b].size());
  s.engine->readiness().arm(s.buckets());
  s.done = false;
  s.armed = true;
  for (size_t k : unused) {
    CHORUS_CHECK(k < n, "HookReducer: unused parameter ", k, " out of range (", n, " parameters)");
    CHORUS_CHECK(!s.unused[k], "HookReducer: parameter ", k, " named unused twice");
    s.mark_unused(k);
  }
  // Marked ready after all are flagged, so that a bucket of unused parameters
  // only launches in its turn; with every parameter unused, this finishes.
  for (size_t k : unused) s.mark_ready(k);
}

void HookReducer::flush() {
  State& s = *state_;
  std::lock_guard<std::mutex> lk(s.mu);
  if (!s.armed) return;
  const std::vector<size_t> late = s.engine->readiness().not_ready();
  for (size_t k : late) s.mark_unused(k);
  for (size_t k : late) s.mark_ready(k);
}

void HookReducer::abandon() {
  State& s = *state_;
  std::lock_guard<std::mutex> lk(s.mu);
  if (s.armed) s.engine->join_quietly();
  s.armed = false;
  s.done = false;
}

std::vector<size_t> HookReducer::unused() const {
  std::lock_guard<std::mutex> lk(state_->mu);
  std::vector<size_t> out;
  for (size_t k = 0; k < state_->unused.size(); ++k)
    if (state_->unused[k]) out.push_back(k);
  return out;
}

Tensor HookReducer::reduced_grad(size_t k) const {
  std::lock_guard<std::mutex> lk(state_->mu);
  CHORUS_CHECK(state_->done, "HookReducer: reduced_grad before the reduction finished");
  CHORUS_CHECK(k < state_->params.size(), "HookReducer: parameter ", k, " out of range");
  return state_->result_view(k);
}

bool HookReducer::finished() const {
  std::lock_guard<std::mutex> lk(state_->mu);
  return state_->done;
}

std::vector<size_t> HookReducer::ready_order() const {
  std::lock_guard<std::mutex> lk(state_->mu);
  return state_->engine->readiness().ready_order();
}

void HookReducer::rebuild_buckets() {
  State& s = *state_;
  std::lock_guard<std::mutex> lk(s.mu);
  CHORUS_CHECK(!s.armed, "HookReducer: rebuild_buckets during an armed backward");
  CHORUS_CHECK(!s.engine->readiness().recording(),
               "HookReducer: rebuild_buckets before a complete armed backward recorded the order");
  s.plan(s.engine->readiness().ready_order());
}

void HookReducer::rebuild_buckets_from(const std::vector<size_t>& order) {
  State& s = *state_;
  std::lock_guard<std::mutex> lk(s.mu);
  CHORUS_CHECK(!s.armed, "HookReducer: rebuild_buckets during an armed backward");
  s.plan(order);
  s.engine->readiness().stop_recording();
}

const GradBuckets& HookReducer::buckets() const { return state_->buckets(); }

double HookReducer::join_seconds() const {
  std::lock_guard<std::mutex> lk(state_->mu);
  return state_->engine->join_seconds();
}

std::vector<Tensor> HookReducer::bucket_buffers(size_t b) const {
  std::lock_guard<std::mutex> lk(state_->mu);
  return state_->buffers.at(b);
}

}  // namespace chorus::dist
