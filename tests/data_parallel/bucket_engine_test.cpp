// The gradient reducer's engine (data_parallel/bucket_engine.h, Note [One
// reducer engine]) on its own: ready counts over a random bucket plan, the two
// launch orders, the parameters left unready, the recorded ready order, the
// views of a bucket and the join's timing, against what the plan says.
#include <gtest/gtest.h>

#include <chorus/chorus.h>
#include <chorus/data_parallel/bucket_engine.h>

#include <algorithm>
#include <chrono>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "testing/compare.h"
#include "testing/expect_error.h"

namespace chorus::dist {
namespace {

// Random parameters of two dtypes and random sizes, in small buckets (so that
// there are many).
std::vector<Tensor> random_params(uint64_t seed, size_t n) {
  std::mt19937_64 rng(seed);
  manual_seed(seed);
  std::vector<Tensor> ps;
  for (size_t k = 0; k < n; ++k) {
    const int64_t a = 1 + static_cast<int64_t>(rng() % 7), b = 1 + static_cast<int64_t>(rng() % 5);
    ps.push_back(randn({a, b}, {rng() % 3 == 0 ? kFloat64 : kFloat32, cpu_device(0)}));
  }
  return ps;
}

// Sums its one replica's buffer into nothing: returns the buffer; join sleeps
// so that the engine's join time can be checked.
class SleepyHook final : public CommHook {
 public:
  Tensor reduce(std::vector<Tensor>& srcs, const std::vector<Event>&) override {
    ++reduces;
    return srcs[0];
  }
  void join(const Device&) override {
    ++joins;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  int reduces = 0, joins = 0;
};

TEST(BucketEngine, InOrderLaunchesEachBucketOnceInIndexOrderWhateverTheReadyOrder) {
  const std::vector<Tensor> ps = random_params(11, 23);
  const GradBuckets plan(ps, /*bucket_bytes=*/96);
  ASSERT_GT(plan.size(), 4u);
  for (uint64_t seed : {1u, 2u, 3u}) {
    BucketReadiness r(BucketReadiness::Order::InOrder);
    r.arm(plan);
    std::vector<size_t> order(ps.size());
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937_64(seed));
    std::vector<size_t> launched;
    std::vector<char> seen(ps.size(), 0);
    for (size_t k : order) {
      seen[k] = 1;
      r.mark_ready(k, [&](size_t b) {
        // Launched only once every parameter of it and of every earlier
        // bucket is ready.
        for (size_t c = 0; c <= b; ++c)
          for (size_t j : plan.buckets[c].ks) EXPECT_TRUE(seen[j]) << "bucket " << b << " launched before " << j;
        launched.push_back(b);
      });
    }
    std::vector<size_t> want(plan.size());
    std::iota(want.begin(), want.end(), 0);
    EXPECT_EQ(launched, want);
    EXPECT_TRUE(r.all_launched());
    EXPECT_TRUE(r.not_ready().empty());
  }
}

TEST(BucketEngine, AsReadyLaunchesABucketTheMomentItCompletes) {
  const std::vector<Tensor> ps = random_params(12, 19);
  const GradBuckets plan(ps, 80);
  BucketReadiness r(BucketReadiness::Order::AsReady);
  r.arm(plan);
  // The first parameters first: with buckets filled from the last parameter
  // to the first, the last bucket completes first and launches at once.
  std::vector<size_t> launched;
  std::vector<size_t> left(plan.size());
  for (size_t k = 0; k < ps.size(); ++k) ++left[plan.bucket_of[k]];
  for (size_t k = 0; k < ps.size(); ++k) {
    const size_t before = launched.size();
    r.mark_ready(k, [&](size_t b) { launched.push_back(b); });
    --left[plan.bucket_of[k]];
    EXPECT_EQ(launched.size(), before + (left[plan.bucket_of[k]] == 0 ? 1 : 0));
  }
  ASSERT_EQ(launched.size(), plan.size());
  EXPECT_EQ(launched.front(), plan.size() - 1);
  EXPECT_TRUE(r.all_launched());
}

TEST(BucketEngine, UnreadyParametersAreNamedAndTwiceReadyIsRefused) {
  const std::vector<Tensor> ps = random_params(13, 9);
  const GradBuckets plan(ps, 64);
  BucketReadiness r;
  r.arm(plan);
  const auto none = [](size_t) {};
  for (size_t k : {1u, 4u, 7u}) r.mark_ready(k, none);
  EXPECT_EQ(r.not_ready(), (std::vector<size_t>{0, 2, 3, 5, 6, 8}));
  EXPECT_FALSE(r.all_launched());
  EXPECT_TRUE(r.is_ready(4));
  EXPECT_TRUE(test::throws_naming([&] { r.mark_ready(4, none); }, {"parameter 4", "became ready twice"}));
  for (size_t k : r.not_ready()) r.mark_ready(k, none);
  EXPECT_TRUE(r.all_launched());
}

TEST(BucketEngine, TheFirstBackwardsOrderIsRecordedAndKept) {
  const std::vector<Tensor> ps = random_params(14, 12);
  const GradBuckets plan(ps, 64);
  BucketReadiness r;
  std::vector<size_t> first(ps.size());
  std::iota(first.begin(), first.end(), 0);
  std::shuffle(first.begin(), first.end(), std::mt19937_64(5));
  r.arm(plan);
  for (size_t k : first) r.mark_ready(k, [](size_t) {});
  EXPECT_TRUE(r.ready_order().empty()) << "empty while recording";
  r.stop_recording();
  EXPECT_EQ(r.ready_order(), first);
  // A later backward in another order leaves the recorded one.
  r.arm(plan);
  for (size_t k = 0; k < ps.size(); ++k) r.mark_ready(k, [](size_t) {});
  EXPECT_EQ(r.ready_order(), first);
}

TEST(BucketEngine, ViewsAreTheParametersSegmentsAndTheJoinIsTimed) {
  const std::vector<Tensor> ps = random_params(15, 10);
  auto plan = std::make_shared<const GradBuckets>(ps, 72);
  auto hook = std::make_shared<SleepyHook>();
  BucketEngine engine(plan, hook, BucketReadiness::Order::InOrder);
  for (size_t k = 0; k < ps.size(); ++k) {
    const GradBuckets::Place pl = plan->place(k);
    const FlatLayout& layout = plan->buckets[pl.bucket].layout;
    Tensor flat = randn({layout.numels[pl.group]}, {layout.dtypes[pl.group], cpu_device(0)});
    Tensor v = engine.view(k, flat);
    EXPECT_EQ(v.sizes(), ps[k].sizes());
    EXPECT_EQ(v.storage(), flat.storage());
    // The same elements as the flat buffer's [offset, offset + numel).
    const Tensor want = flat.narrow(0, pl.offset, pl.numel).reshape(ps[k].sizes());
    EXPECT_EQ(test::rel_err(v, want), 0.0) << "parameter " << k;
    std::vector<Tensor> one{flat};
    EXPECT_EQ(engine.reduce(one, {}).storage(), flat.storage());
  }
  EXPECT_EQ(hook->reduces, static_cast<int>(ps.size()));
  const double s = engine.join({cpu_device(0), cpu_device(1)});
  EXPECT_EQ(hook->joins, 2);
  EXPECT_GE(s, 0.039);
  EXPECT_DOUBLE_EQ(engine.join_seconds(), s);
  engine.join({cpu_device(0)});
  EXPECT_GT(engine.join_seconds(), s + 0.019);
}

}  // namespace
}  // namespace chorus::dist
