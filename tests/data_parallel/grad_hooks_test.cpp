// The gradient reducer's hook form (data_parallel/grad_hooks.h, DDP's) on a CPU
// device, against the plain gradients of one backward over the batch, with a
// fake communication that scales each bucket (DDP plugs in a ProcessGroup
// all-reduce instead): gradients become views of their bucket, buckets launch in order
//    while the backward still runs, no_sync-style accumulation, unused
//    parameters, buckets rebuilt from the observed order, inert hooks after
//    the reducer is gone.
#include <gtest/gtest.h>

#include <chorus/chorus.h>
#include <chorus/data_parallel/grad_hooks.h>
#include <chorus/ops/copy.h>

#include <memory>
#include <vector>

#include "testing/compare.h"
#include "testing/expect_error.h"

namespace chorus::dist {
namespace {

using test::rel_err;
constexpr double kTol = 1e-5;

// A two-layer net of four float32 parameters and one float64 parameter (so
// that buckets hold two dtype groups): loss = |relu(x W1 + b1) W2 + b2 - y|^2
// + sum(x64 * p64).
struct Net {
  std::vector<Tensor> params;  // W1 [5,4], b1 [4], W2 [4,3], b2 [3], p64 [6]
  static Net make(const Device& d, uint64_t seed) {
    manual_seed(seed);
    Net n;
    n.params = {randn({5, 4}, {kFloat32, d}), randn({4}, {kFloat32, d}), randn({4, 3}, {kFloat32, d}),
                randn({3}, {kFloat32, d}), randn({6}, {kFloat64, d})};
    return n;
  }
  Net copy_to(const Device& d) const {
    Net n;
    for (const Tensor& p : params) n.params.push_back(p.to(d).clone());
    return n;
  }
  void require_grad() {
    for (Tensor& p : params) p.set_requires_grad(true);
  }
};

struct Batch {
  Tensor x, y, x64;
};

Batch make_batch(int64_t n, uint64_t seed) {
  manual_seed(seed);
  return {randn({n, 5}), randn({n, 3}), randn({n, 6}, {kFloat64, cpu_device(0)})};
}

Batch chunk(const Batch& b, int64_t start, int64_t len, const Device& d) {
  return {b.x.narrow(0, start, len).to(d), b.y.narrow(0, start, len).to(d), b.x64.narrow(0, start, len).to(d)};
}

Tensor loss_of(const std::vector<Tensor>& p, const Batch& b, bool use_p64 = true) {
  Tensor h = (b.x.matmul(p[0]) + p[1]).relu();
  Tensor loss = (h.matmul(p[2]) + p[3] - b.y).pow(2.0).sum();
  if (use_p64) loss = loss + (b.x64 * p[4]).sum().to(kFloat32);
  return loss;
}

// The independent reference: the plain gradients of one backward.
std::vector<Tensor> reference_grads(const Net& net, const Batch& b, bool use_p64 = true) {
  Net ref = net.copy_to(cpu_device(0));
  ref.require_grad();
  loss_of(ref.params, b, use_p64).backward();
  std::vector<Tensor> out;
  for (const Tensor& p : ref.params) out.push_back(p.grad());
  return out;
}

// Wraps another communication, scales each result in place, and records the
// order of its calls and the state of a watched gradient at each call.
class ScaleComm final : public CommHook {
 public:
  ScaleComm(double scale, std::shared_ptr<CommHook> inner = nullptr) : scale_(scale), inner_(std::move(inner)) {}
  Tensor reduce(std::vector<Tensor>& bufs, const std::vector<Event>& ready) override {
    Tensor out = inner_ ? inner_->reduce(bufs, ready) : bufs[0];
    out.mul_(scale_);
    calls.push_back(bufs[0]);
    if (watch.defined()) watched_grad_at_call.push_back(watch.grad().defined());
    return out;
  }
  void join(const Device& device) override {
    ++joins;
    if (inner_) inner_->join(device);
  }
  std::vector<Tensor> calls;
  int joins = 0;
  Tensor watch;
  std::vector<bool> watched_grad_at_call;

 private:
  double scale_;
  std::shared_ptr<CommHook> inner_;
};

int64_t bytes_of(const Tensor& t) { return t.numel() * static_cast<int64_t>(dtype_size(t.dtype())); }

// ---- the bucket plan ----------------------------------------------------------

TEST(GradBuckets, AnExplicitOrderFillsTheBuckets) {
  const Net net = Net::make(cpu_device(0), 2);
  GradBuckets b(net.params, bytes_of(net.params[0]) + 1, 0, {0, 2, 1, 3, 4});
  ASSERT_EQ(b.buckets.size(), 2u);
  EXPECT_EQ(b.buckets[0].ks, (std::vector<size_t>{0, 2}));
  EXPECT_EQ(b.buckets[1].ks, (std::vector<size_t>{1, 3, 4}));
  EXPECT_TRUE(test::throws_naming([&] { GradBuckets(net.params, 0, 0, {0, 1, 1, 3, 4}); }, {"permutation", "repeated"}));
  EXPECT_TRUE(test::throws_naming([&] { GradBuckets(net.params, 0, 0, {0, 1}); }, {"order names 2"}));
}

TEST(GradBuckets, ExplicitGroupsAreTheBuckets) {
  // ZeRO-3's units: each group one bucket, its segments in the group's order.
  const Net net = Net::make(cpu_device(0), 2);
  GradBuckets b = GradBuckets::from_groups(net.params, {{3, 1}, {0}, {4, 2}});
  ASSERT_EQ(b.buckets.size(), 3u);
  EXPECT_EQ(b.buckets[0].ks, (std::vector<size_t>{3, 1}));
  EXPECT_EQ(b.bucket_of[2], 2u);
  EXPECT_EQ(b.index_in_bucket[2], 1u);
  // Shards of a unit tile it for any world size.
  for (int world : {1, 2, 3, 5})
    for (size_t k = 0; k < net.params.size(); ++k) {
      int64_t covered = 0;
      for (int r = 0; r < world; ++r) covered += b.shard_of_param(k, r, world).numel();
      EXPECT_EQ(covered, net.params[k].numel()) << "parameter " << k << ", world " << world;
    }
  EXPECT_TRUE(test::throws_naming([&] { GradBuckets::from_groups(net.params, {{0, 1}, {1, 2, 3, 4}}); },
                                  {"do not partition", "repeated"}));
  EXPECT_TRUE(test::throws_naming([&] { GradBuckets::from_groups(net.params, {{0, 1}, {2, 3}}); },
                                  {"parameter 4 is in no group"}));
  EXPECT_TRUE(test::throws_naming([&] { GradBuckets::from_groups(net.params, {{0, 1, 2, 3, 4}, {}}); },
                                  {"bucket 1 is empty"}));
}

// Note [Released storage]: the views of a released storage see what is
// written after it is allocated again (the autograd graph's saved weights at
// ZeRO-3's second gather).
TEST(Storage, ReleasedAndReallocatedKeepsItsViews) {
  Tensor full = randn({10}, {kFloat64});
  Tensor view = full.narrow(0, 2, 5);
  full.storage()->release();
  EXPECT_TRUE(full.storage()->released());
  full.storage()->release();  // twice: a no-op
  full.storage()->reallocate();
  EXPECT_FALSE(full.storage()->released());
  Tensor values = randn({10}, {kFloat64});
  ops::copy_(full, values);
  EXPECT_EQ(view.to_vector<double>(), values.narrow(0, 2, 5).contiguous().to_vector<double>());
}

// ---- Reducer: the hook form -----------------------------------------------------

TEST(HookReducer, GradientsAreTheReducedBucketsAndViewsOfThem) {
  Net net = Net::make(cpu_device(0), 7);
  const Batch b = make_batch(6, 8);
  const std::vector<Tensor> ref = reference_grads(net, b);
  net.require_grad();
  auto comm = std::make_shared<ScaleComm>(3.0);
  HookReducer reducer(net.params, comm, {.bucket_bytes = 0});
  for (int step = 0; step < 2; ++step) {
    for (Tensor& p : net.params) p.zero_grad();
    reducer.prepare_for_backward();
    EXPECT_FALSE(reducer.finished());
    loss_of(net.params, b).backward();
    EXPECT_TRUE(reducer.finished());
    for (size_t k = 0; k < ref.size(); ++k) {
      EXPECT_LE(rel_err(net.params[k].grad(), ref[k] * 3.0), kTol) << "step " << step << " parameter " << k;
      const size_t g = reducer.buckets().buckets[0].layout.segments[reducer.buckets().index_in_bucket[k]].group;
      EXPECT_EQ(net.params[k].grad().storage().get(), reducer.bucket_buffers(0)[g].storage().get());
    }
  }
  EXPECT_EQ(comm->calls.size(), 4u);  // two dtype groups, two steps
  EXPECT_EQ(comm->joins, 2);
}

TEST(HookReducer, BucketsLaunchInOrderWhileTheBackwardStillRuns) {
  Net net = Net::make(cpu_device(0), 9);
  const Batch b = make_batch(6, 10);
  net.require_grad();
  auto comm = std::make_shared<ScaleComm>(1.0);
  comm->watch = net.params[0];  // W1: the last gradient of the float32 net
  HookReducer reducer(net.params, comm, {.bucket_bytes = 1});
  reducer.prepare_for_backward({4});  // p64's bucket (the first) goes out at once, as zeros
  loss_of(net.params, b, /*use_p64=*/false).backward();
  ASSERT_TRUE(reducer.finished());
  ASSERT_EQ(comm->calls.size(), 5u);
  for (size_t c = 0; c < 5; ++c)
    EXPECT_EQ(comm->calls[c].storage().get(), reducer.bucket_buffers(c)[0].storage().get()) << "call " << c;
  // b2's bucket went out before W1's gradient existed.
  EXPECT_FALSE(comm->watched_grad_at_call[1]);
  EXPECT_TRUE(comm->watched_grad_at_call[4]);
}

TEST(HookReducer, AnUnarmedBackwardAccumulatesAndTheNextArmedOneReducesTheSum) {
  Net net = Net::make(cpu_device(0), 11);
  const Batch b1 = make_batch(4, 12), b2 = make_batch(4, 13), b3 = make_batch(4, 14);
  const std::vector<Tensor> g1 = reference_grads(net, b1), g2 = reference_grads(net, b2),
                            g3 = reference_grads(net, b3);
  net.require_grad();
  auto comm = std::make_shared<ScaleComm>(2.0);
  HookReducer reducer(net.params, comm, {.bucket_bytes = 64});
  loss_of(net.params, b1).backward();  // no_sync: nothing reduced
  EXPECT_TRUE(comm->calls.empty());
  for (size_t k = 0; k < g1.size(); ++k) EXPECT_LE(rel_err(net.params[k].grad(), g1[k]), kTol);
  reducer.prepare_for_backward();
  loss_of(net.params, b2).backward();
  for (size_t k = 0; k < g1.size(); ++k) EXPECT_LE(rel_err(net.params[k].grad(), (g1[k] + g2[k]) * 2.0), kTol);
  // Without zero_grad the next backward accumulates into the bucket views in
  // place (no copy), and reduces that.
  std::vector<const void*> storages;
  for (const Tensor& p : net.params) storages.push_back(p.grad().storage().get());
  reducer.prepare_for_backward();
  loss_of(net.params, b3).backward();
  for (size_t k = 0; k < g1.size(); ++k) {
    EXPECT_LE(rel_err(net.params[k].grad(), ((g1[k] + g2[k]) * 2.0 + g3[k]) * 2.0), kTol) << "parameter " << k;
    EXPECT_EQ(net.params[k].grad().storage().get(), storages[k]);
  }
}

TEST(HookReducer, UnusedParametersMustBeNamed) {
  Net net = Net::make(cpu_device(0), 15);
  const Batch b = make_batch(5, 16);
  const std::vector<Tensor> ref = reference_grads(net, b, /*use_p64=*/false);
  net.require_grad();
  auto comm = std::make_shared<ScaleComm>(1.5);
  HookReducer reducer(net.params, comm, {.bucket_bytes = 1});
  reducer.prepare_for_backward({4});
  loss_of(net.params, b, /*use_p64=*/false).backward();
  ASSERT_TRUE(reducer.finished());
  EXPECT_FALSE(net.params[4].grad().defined()) << "an unused parameter keeps its (absent) gradient";
  for (size_t k = 0; k < 4; ++k) EXPECT_LE(rel_err(net.params[k].grad(), ref[k] * 1.5), kTol);
  // Not named: the reduction cannot complete, and says so.
  reducer.prepare_for_backward();
  loss_of(net.params, b, /*use_p64=*/false).backward();
  EXPECT_FALSE(reducer.finished());
  EXPECT_TRUE(test::throws_naming([&] { reducer.prepare_for_backward(); }, {"has not finished", "unused"}));
}

TEST(HookReducer, BucketsAreRebuiltFromTheObservedOrder) {
  Net net = Net::make(cpu_device(0), 17);
  const Batch b = make_batch(6, 18);
  const std::vector<Tensor> ref = reference_grads(net, b);
  net.require_grad();
  auto comm = std::make_shared<ScaleComm>(1.0);
  HookReducer reducer(net.params, comm, {.bucket_bytes = 1});
  EXPECT_TRUE(reducer.ready_order().empty());
  EXPECT_TRUE(test::throws_naming([&] { reducer.rebuild_buckets(); }, {"before a complete armed backward"}));
  reducer.prepare_for_backward();
  loss_of(net.params, b).backward();
  const std::vector<size_t> order = reducer.ready_order();
  ASSERT_EQ(order.size(), 5u);
  reducer.rebuild_buckets();
  for (size_t i = 0; i < order.size(); ++i) EXPECT_EQ(reducer.buckets().buckets[i].ks[0], order[i]);
  // Rebuilt, the first bucket goes out before the last gradient exists.
  comm->watch = net.params[order.back()];
  for (Tensor& p : net.params) p.zero_grad();
  reducer.prepare_for_backward();
  loss_of(net.params, b).backward();
  ASSERT_TRUE(reducer.finished());
  ASSERT_EQ(comm->watched_grad_at_call.size(), 5u);
  EXPECT_FALSE(comm->watched_grad_at_call[0]);
  for (size_t k = 0; k < ref.size(); ++k) EXPECT_LE(rel_err(net.params[k].grad(), ref[k]), kTol);
}

TEST(HookReducer, HooksOutliveTheReducerHarmlessly) {
  Net net = Net::make(cpu_device(0), 19);
  const Batch b = make_batch(4, 20);
  const std::vector<Tensor> ref = reference_grads(net, b);
  net.require_grad();
  {
    HookReducer reducer(net.params, std::make_shared<ScaleComm>(4.0), {});
    reducer.prepare_for_backward();
  }
  loss_of(net.params, b).backward();
  for (size_t k = 0; k < ref.size(); ++k) EXPECT_LE(rel_err(net.params[k].grad(), ref[k]), kTol);
}

TEST(HookReducer, BadParametersAreValueErrors) {
  Net net = Net::make(cpu_device(0), 21);
  auto comm = std::make_shared<ScaleComm>(1.0);
  EXPECT_TRUE(test::throws_naming([&] { HookReducer(net.params, comm); }, {"parameter 0", "requires grad"}));
  net.require_grad();
  EXPECT_TRUE(test::throws_naming([&] { HookReducer({net.params[0], net.params[0]}, comm); }, {"same tensor"}));
}

}  // namespace
}  // namespace chorus::dist
