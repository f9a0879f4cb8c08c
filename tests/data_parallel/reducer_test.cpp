// dist::Reducer, the gradient reducer shared by DataParallel and (next)
// DistributedDataParallel: bucket assignment (Note [Gradient buckets]), the
// gradient nodes (Note [Gradient nodes]) with a pluggable CommHook, checked
// against gradients computed by plain autograd on the same random inputs.
#include <gtest/gtest.h>

#include <chorus/chorus.h>
#include <chorus/data_parallel/in_process_hooks.h>
#include <chorus/data_parallel/reducer.h>
#include <chorus/ops/elementwise.h>

#include "testing/compare.h"
#include "testing/expect_error.h"

namespace chorus::dist {
namespace {

Tensor param(const Shape& shape, const Device& d = cpu_device(0)) {
  Tensor t = randn(shape, {kFloat32, d});
  t.set_requires_grad(true);
  return t;
}

int64_t bytes_of(const Tensor& t) { return t.numel() * static_cast<int64_t>(dtype_size(t.dtype())); }

TEST(GradBuckets, LastParametersFirstAndCappedBySize) {
  std::vector<Tensor> ps = {param({100}), param({50}), param({200}), param({10})};  // 400, 200, 800, 40 bytes
  GradBuckets one(ps, 0);
  ASSERT_EQ(one.buckets.size(), 1u);
  EXPECT_EQ(one.buckets[0].ks, (std::vector<size_t>{3, 2, 1, 0}));
  GradBuckets capped(ps, 800);  // closes once a bucket holds >= 800 bytes
  ASSERT_EQ(capped.buckets.size(), 2u);
  EXPECT_EQ(capped.buckets[0].ks, (std::vector<size_t>{3, 2}));
  EXPECT_EQ(capped.buckets[1].ks, (std::vector<size_t>{1, 0}));
  GradBuckets first_small(ps, 800, 40);  // the first bucket closes early: communication starts sooner
  ASSERT_EQ(first_small.buckets.size(), 3u);
  EXPECT_EQ(first_small.buckets[0].ks, (std::vector<size_t>{3}));
  EXPECT_EQ(first_small.buckets[1].ks, (std::vector<size_t>{2}));
  EXPECT_EQ(first_small.buckets[2].ks, (std::vector<size_t>{1, 0}));
  for (size_t k = 0; k < ps.size(); ++k) {
    const auto& b = first_small.buckets[first_small.bucket_of[k]];
    EXPECT_EQ(b.ks[first_small.index_in_bucket[k]], k);
  }
  int64_t total = 0;
  for (const auto& p : ps) total += bytes_of(p);
  EXPECT_EQ(total, 1440);
}

TEST(GradBuckets, TheFirstLayersGetATailBucketOfTheirOwn) {
  // 400, 200, 800, 40, 120 bytes; filled last to first: 4, 3, 2, 1, 0.
  std::vector<Tensor> ps = {param({100}), param({50}), param({200}), param({10}), param({30})};
  GradBuckets tail(ps, 2000, 0, {}, 600);  // parameters 1 and 0 (200 + 400 bytes) fit in 600
  ASSERT_EQ(tail.buckets.size(), 2u);
  EXPECT_EQ(tail.buckets[0].ks, (std::vector<size_t>{4, 3, 2}));
  EXPECT_EQ(tail.buckets[1].ks, (std::vector<size_t>{1, 0}));
  GradBuckets one_param(ps, 2000, 0, {}, 100);  // even the last alone is larger: it is the tail
  ASSERT_EQ(one_param.buckets.size(), 2u);
  EXPECT_EQ(one_param.buckets[1].ks, (std::vector<size_t>{0}));
  // With size caps and a first bucket: 4 | 3, 2 | 1 | 0 (caps 100, then 500).
  GradBuckets all(ps, 500, 100, {}, 450);
  ASSERT_EQ(all.buckets.size(), 4u);
  EXPECT_EQ(all.buckets[0].ks, (std::vector<size_t>{4}));
  EXPECT_EQ(all.buckets[1].ks, (std::vector<size_t>{3, 2}));
  EXPECT_EQ(all.buckets[2].ks, (std::vector<size_t>{1}));
  EXPECT_EQ(all.buckets[3].ks, (std::vector<size_t>{0}));
  // The tail follows an explicit fill order too: 0 is filled first, 4 last.
  GradBuckets ordered(ps, 0, 0, {0, 1, 2, 3, 4}, 200);
  ASSERT_EQ(ordered.buckets.size(), 2u);
  EXPECT_EQ(ordered.buckets[1].ks, (std::vector<size_t>{3, 4}));
  EXPECT_TRUE(test::throws_naming(
      [&] { Reducer({ps[0]}, std::make_shared<InProcessSum>(), {.bucket_bytes = 10, .last_bucket_bytes = -1}); },
      {"last_bucket_bytes"}));
}

// The plan's sharding for ZeRO: every rank owns one equal, aligned,
// contiguous piece of each flat buffer (padded at its end); a parameter's
// pieces over the ranks tile its segment exactly.
TEST(GradBuckets, ShardsTileEveryBucketAndEveryParameter) {
  // float32: 100, 50, 10 elements; filled 2, 1, 0 at offsets 0, 32, 96
  // (segments start on 128-byte boundaries); one float64 parameter of 7.
  std::vector<Tensor> ps = {param({100}), param({50}), param({10}), randn({7}, {kFloat64, cpu_device(0)})};
  GradBuckets plan(ps, 0);
  ASSERT_EQ(plan.size(), 1u);
  EXPECT_EQ(plan.buckets[0].device, cpu_device(0));
  const GradBuckets::Place p1 = plan.place(1);
  EXPECT_EQ(p1.bucket, 0u);
  EXPECT_EQ(p1.offset, 32);
  EXPECT_EQ(p1.numel, 50);
  EXPECT_EQ(plan.place(0).offset, 96);
  EXPECT_NE(plan.place(3).group, plan.place(0).group);
  // 196 float32 elements over 4 ranks: 49 each, rounded up to 32 (128 bytes).
  EXPECT_EQ(plan.padded_numel(0, p1.group, 4), 256);
  EXPECT_EQ(plan.shard(0, p1.group, 1, 4).begin, 64);
  EXPECT_EQ(plan.shard(0, p1.group, 1, 4).end, 128);
  EXPECT_EQ(plan.shard_of_param(1, 0, 4).begin, 32);
  EXPECT_EQ(plan.shard_of_param(1, 0, 4).end, 64);
  EXPECT_EQ(plan.shard_of_param(1, 2, 4).numel(), 0);
  for (int world : {1, 2, 3, 4, 7}) {
    for (size_t g = 0; g < plan.buckets[0].layout.groups(); ++g) {
      const int64_t padded = plan.padded_numel(0, g, world);
      EXPECT_GE(padded, plan.buckets[0].layout.numels[g]);
      for (int r = 0; r < world; ++r) {
        const GradBuckets::Range s = plan.shard(0, g, r, world);
        EXPECT_EQ(s.begin, padded / world * r);
        EXPECT_EQ(s.numel(), padded / world);
      }
    }
    for (size_t k = 0; k < ps.size(); ++k) {
      const GradBuckets::Place pk = plan.place(k);
      int64_t covered = 0, next = pk.offset;
      for (int r = 0; r < world; ++r) {
        const GradBuckets::Range piece = plan.shard_of_param(k, r, world);
        if (piece.numel() == 0) continue;
        EXPECT_EQ(piece.begin, next) << "parameter " << k << ", rank " << r << " of " << world;
        next = piece.end;
        covered += piece.numel();
      }
      EXPECT_EQ(covered, pk.numel) << "parameter " << k << ", world " << world;
    }
  }
  EXPECT_TRUE(test::throws_naming([&] { (void)plan.shard(0, 0, 4, 4); }, {"rank 4"}));
  EXPECT_TRUE(test::throws_naming([&] { (void)plan.padded_numel(0, 0, 0); }, {"world size"}));
  EXPECT_TRUE(test::throws_naming([&] { GradBuckets(ps, -1); }, {"bucket_bytes"}));
}

// A CommHook standing in for DDP's all-reduce over a process group: the sum
// over this process's replicas, then a known transformation (here: times
// `scale`, as an average over ranks would be), issued once per bucket.
class ScaledSum final : public CommHook {
 public:
  explicit ScaledSum(double scale) : scale_(scale) {}
  Tensor reduce(std::vector<Tensor>& srcs, const std::vector<Event>& ready) override {
    ++calls;
    Tensor sum = in_process_.reduce(srcs, ready);
    return ops::unary(UnaryOp::MulScalar, sum, scale_);
  }
  void join(const Device& d) override {
    ++joins;
    in_process_.join(d);
  }
  int calls = 0, joins = 0;

 private:
  double scale_;
  InProcessSum in_process_;
};

// One replica (DDP's usual case: one device per process), a custom comm:
// .grad == scale * the plain gradient, unused parameters get none, and the
// gradients are views of their bucket.
TEST(Reducer, OneReplicaWithACustomCommMatchesPlainAutograd) {
  manual_seed(11);
  Tensor w1 = param({6, 5}), b1 = param({6}), w2 = param({3, 6}), unused = param({4});
  std::vector<Tensor> ps = {w1, b1, w2, unused};
  Tensor x = randn({8, 5});
  auto forward = [&](const std::vector<Tensor>& p) {
    Tensor h = chorus::relu(chorus::add(x.matmul(p[0].t()), p[1]));
    return chorus::sum(chorus::mul(h.matmul(p[2].t()), h.matmul(p[2].t())));
  };
  // The reference: plain autograd on clones.
  std::vector<Tensor> ref;
  for (const Tensor& p : ps) {
    Tensor c = p.detach().clone();
    c.set_requires_grad(true);
    ref.push_back(c);
  }
  forward(ref).backward();

  auto comm = std::make_shared<ScaledSum>(0.5);
  Reducer reducer(ps, comm, {.bucket_bytes = 100});  // several buckets
  ASSERT_GT(reducer.buckets().buckets.size(), 1u);
  auto recorded = reducer.record({cpu_device(0)}, {ps});
  forward(recorded[0]).backward();
  int with_used = 0;  // buckets holding a parameter the loss uses: each reduced once
  for (const auto& b : reducer.buckets().buckets)
    with_used += std::any_of(b.ks.begin(), b.ks.end(), [](size_t k) { return k < 3; });
  EXPECT_EQ(comm->calls, with_used);
  EXPECT_EQ(comm->joins, 1);
  for (size_t k = 0; k < 3; ++k) {
    ASSERT_TRUE(ps[k].grad().defined()) << k;
    Tensor want = ops::unary(UnaryOp::MulScalar, ref[k].grad(), 0.5);
    EXPECT_LE(test::rel_err(ps[k].grad(), want), 1e-6) << "parameter " << k;
  }
  EXPECT_FALSE(unused.grad().defined()) << "a parameter no replica used gets no gradient";
}

TEST(Reducer, GradientsAreViewsOfTheirBucket) {
  Tensor a = param({7}), b = param({9});
  auto comm = std::make_shared<ScaledSum>(1.0);
  Reducer reducer({a, b}, comm, {.bucket_bytes = 0});  // one bucket for both
  auto rec = reducer.record({cpu_device(0)}, {{a, b}});
  chorus::add(chorus::sum(rec[0][0]), chorus::sum(chorus::mul(rec[0][1], rec[0][1]))).backward();
  ASSERT_TRUE(a.grad().defined() && b.grad().defined());
  EXPECT_EQ(a.grad().storage(), b.grad().storage()) << "no copy per parameter: both live in the bucket's buffer";
}

// Two replicas on two CPU devices with the in-process sum (DataParallel's
// case): each master's gradient is the sum of both replicas' gradients.
TEST(Reducer, InProcessSumOverTwoDevices) {
  manual_seed(12);
  Tensor w = param({4, 3}), v = param({4});
  Tensor w1 = w.detach().to(cpu_device(1)), v1 = v.detach().to(cpu_device(1));
  Tensor x0 = randn({5, 3}), x1 = randn({5, 3}, {kFloat32, cpu_device(1)});
  auto loss = [](const Tensor& x, const Tensor& w_, const Tensor& v_) {
    return chorus::sum(chorus::tanh(chorus::add(x.matmul(w_.t()), v_)));
  };
  std::vector<Tensor> ref = {w.detach().clone(), v.detach().clone()};
  for (auto& r : ref) r.set_requires_grad(true);
  chorus::add(loss(x0, ref[0], ref[1]), loss(x1.to(cpu_device(0)), ref[0], ref[1])).backward();

  Reducer reducer({w, v}, std::make_shared<InProcessSum>(), {.bucket_bytes = 20});
  auto rec = reducer.record({cpu_device(0), cpu_device(1)}, {{w, v}, {w1, v1}});
  Tensor l = chorus::add(loss(x0, rec[0][0], rec[0][1]), loss(x1, rec[1][0], rec[1][1]).to(cpu_device(0)));
  l.backward();
  EXPECT_LE(test::rel_err(w.grad(), ref[0].grad()), 1e-6);
  EXPECT_LE(test::rel_err(v.grad(), ref[1].grad()), 1e-6);
  EXPECT_EQ(w.grad().device(), cpu_device(0));
}

TEST(Reducer, RejectsBadOptions) {
  Tensor a = param({3});
  EXPECT_THROW(Reducer({a}, std::make_shared<InProcessSum>(), {.bucket_bytes = -1}), ValueError);
  EXPECT_THROW(Reducer({a}, std::make_shared<InProcessSum>(), {.bucket_bytes = 10, .first_bucket_bytes = -2}),
               ValueError);
  EXPECT_THROW(Reducer({a}, nullptr), ValueError);
}

}  // namespace
}  // namespace chorus::dist
