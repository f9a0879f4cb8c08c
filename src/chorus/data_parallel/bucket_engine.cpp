#include "chorus/data_parallel/bucket_engine.h"

#include <chrono>

#include "chorus/core/error.h"
#include "chorus/ops/profile.h"

namespace chorus::dist {

// ---- BucketReadiness (Note [One reducer engine]) ---------------------------

void BucketReadiness::arm(const GradBuckets& plan) {
  plan_ = &plan;
  ready_.assign(plan.bucket_of.size(), 0);
  pending_.assign(plan.buckets.size(), 0);
  launched_of_.assign(plan.buckets.size(), 0);
  for (size_t k = 0; k < plan.bucket_of.size(); ++k) ++pending_[plan.bucket_of[k]];
  next_ = 0;
  launched_ = 0;
  if (recording_) order_seen_.clear();
}

void BucketReadiness::mark_ready(size_t k, const std::function<void(size_t)>& launch) {
  CHORUS_ASSERT(plan_ != nullptr && k < ready_.size());
  CHORUS_CHECK(!ready_[k], "gradient reducer: the gradient of parameter ", k,
               " became ready twice in one backward (marked unused, or two backward passes after one arming)");
  ready_[k] = 1;
  if (recording_) order_seen_.push_back(k);
  const size_t b = plan_->bucket_of[k];
  --pending_[b];
  if (order_ == Order::AsReady) {
    if (pending_[b] == 0 && !launched_of_[b]) {
      launched_of_[b] = 1;
      ++launched_;
      launch(b);
    }
    return;
  }
  // Every complete bucket whose predecessors are launched.
  while (next_ < pending_.size() && pending_[next_] == 0) {
    const size_t now = next_++;
    launched_of_[now] = 1;
    ++launched_;
    launch(now);
  }
}

std::vector<size_t> BucketReadiness::not_ready() const {
  std::vector<size_t> out;
  for (size_t k = 0; k < ready_.size(); ++k)
    if (!ready_[k]) out.push_back(k);
  return out;
}

// ---- BucketEngine ------------------------------------------------------------

BucketEngine::BucketEngine(std::shared_ptr<const GradBuckets> plan, std::shared_ptr<CommHook> comm,
                           BucketReadiness::Order order)
    : comm_(std::move(comm)), readiness_(order) {
  CHORUS_CHECK(comm_ != nullptr, "gradient reducer: no communication hook");
  set_plan(std::move(plan));
}

void BucketEngine::set_plan(std::shared_ptr<const GradBuckets> plan) {
  CHORUS_ASSERT(plan != nullptr);
  plan_ = std::move(plan);
}

double BucketEngine::join(const std::vector<Device>& devices) {
  // Note [Step traces]: on CPU (Gloo) this is where the host waits for the
  // other ranks' gradients.
  ops::TraceScope trace("wait_gradients");
  const auto begin = std::chrono::steady_clock::now();
  for (const Device& d : devices) comm_->join(d);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  join_seconds_ += s;
  return s;
}

Tensor BucketEngine::view(size_t k, const Tensor& flat) const {
  const size_t b = plan_->bucket_of[k], i = plan_->index_in_bucket[k];
  return plan_->buckets[b].layout.view(flat, i);
}

}  // namespace chorus::dist
