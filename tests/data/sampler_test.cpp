// Samplers: permutations, per-epoch reshuffles reproducible from the seed,
// and distributed shards that match torch.utils.data.DistributedSampler's
// arithmetic (equal shares, disjoint, covering; padding and drop_last).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <vector>

#include "chorus/core/error.h"
#include "chorus/data/sampler.h"

namespace chorus::data {
namespace {

bool is_permutation_of_range(std::vector<int64_t> v, int64_t n) {
  if (static_cast<int64_t>(v.size()) != n) return false;
  std::sort(v.begin(), v.end());
  for (int64_t i = 0; i < n; ++i)
    if (v[i] != i) return false;
  return true;
}

TEST(DataSampler, Sequential) {
  SequentialSampler s(5);
  EXPECT_EQ(s.size(), 5);
  EXPECT_EQ(s.indices(0), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(s.indices(7), s.indices(0));
  EXPECT_TRUE(SequentialSampler(0).indices(0).empty());
  EXPECT_THROW(SequentialSampler(-1), ValueError);
}

TEST(DataSampler, RandomIsAPermutationEachEpoch) {
  RandomSampler s(1000, 42);
  EXPECT_EQ(s.size(), 1000);
  for (int64_t e = 0; e < 5; ++e) EXPECT_TRUE(is_permutation_of_range(s.indices(e), 1000)) << e;
  for (int64_t n : {0, 1, 2, 3}) EXPECT_TRUE(is_permutation_of_range(RandomSampler(n, 1).indices(0), n));
}

TEST(DataSampler, RandomDiffersAcrossEpochsAndSeedsAndIsReproducible) {
  RandomSampler a(1000, 42), b(1000, 42), c(1000, 43);
  EXPECT_EQ(a.indices(3), b.indices(3));
  EXPECT_NE(a.indices(0), a.indices(1));
  EXPECT_NE(a.indices(0), c.indices(0));
  EXPECT_NE(a.indices(0), SequentialSampler(1000).indices(0));
}

// Each of the n! orders of a small set appears about equally often over
// epochs: Fisher-Yates with an unbiased draw is uniform.
TEST(DataSampler, RandomIsUniformOverSmallPermutations) {
  RandomSampler s(3, 9);
  std::map<std::vector<int64_t>, int> counts;
  const int epochs = 6000;
  for (int e = 0; e < epochs; ++e) ++counts[s.indices(e)];
  ASSERT_EQ(counts.size(), 6u);
  // 1000 expected per order; 5 standard deviations is about 160.
  for (const auto& [order, n] : counts) EXPECT_NEAR(n, 1000, 160);
}

TEST(DataSampler, DistributedShardsAreDisjointAndCover) {
  const int64_t n = 1000, replicas = 4;
  for (int64_t epoch : {0, 1}) {
    std::vector<int64_t> all;
    for (int64_t r = 0; r < replicas; ++r) {
      DistributedSampler s(n, replicas, r, true, 5);
      EXPECT_EQ(s.size(), 250);
      std::vector<int64_t> mine = s.indices(epoch);
      EXPECT_EQ(static_cast<int64_t>(mine.size()), s.size());
      all.insert(all.end(), mine.begin(), mine.end());
    }
    EXPECT_TRUE(is_permutation_of_range(all, n)) << "epoch " << epoch;
  }
  EXPECT_NE(DistributedSampler(n, 4, 0, true, 5).indices(0), DistributedSampler(n, 4, 0, true, 5).indices(1));
}

// 10 examples on 4 ranks: PyTorch pads to 12 by repeating the first two of
// the order, and rank r takes positions r, r+4, r+8.
TEST(DataSampler, DistributedPadsAsPyTorch) {
  std::vector<std::vector<int64_t>> got;
  for (int64_t r = 0; r < 4; ++r) {
    DistributedSampler s(10, 4, r, /*shuffle=*/false);
    EXPECT_EQ(s.size(), 3);
    got.push_back(s.indices(0));
  }
  EXPECT_EQ(got[0], (std::vector<int64_t>{0, 4, 8}));
  EXPECT_EQ(got[1], (std::vector<int64_t>{1, 5, 9}));
  EXPECT_EQ(got[2], (std::vector<int64_t>{2, 6, 0}));
  EXPECT_EQ(got[3], (std::vector<int64_t>{3, 7, 1}));

  // Shuffled: the same padding rule applied to the shared permutation.
  const std::vector<int64_t> order = random_permutation(10, 3, 2);
  std::set<int64_t> seen;
  for (int64_t r = 0; r < 4; ++r) {
    const std::vector<int64_t> mine = DistributedSampler(10, 4, r, true, 3).indices(2);
    for (int64_t i = 0; i < 3; ++i) EXPECT_EQ(mine[i], order[(r + 4 * i) % 10]);
    seen.insert(mine.begin(), mine.end());
  }
  EXPECT_EQ(seen.size(), 10u);

  // Fewer examples than ranks: the order repeats as often as needed.
  for (int64_t r = 0; r < 5; ++r)
    EXPECT_EQ(DistributedSampler(2, 5, r, false).indices(0), (std::vector<int64_t>{r % 2}));
}

TEST(DataSampler, DistributedDropLast) {
  std::vector<int64_t> all;
  for (int64_t r = 0; r < 4; ++r) {
    DistributedSampler s(10, 4, r, false, 0, /*drop_last=*/true);
    EXPECT_EQ(s.size(), 2);
    std::vector<int64_t> mine = s.indices(0);
    all.insert(all.end(), mine.begin(), mine.end());
  }
  std::sort(all.begin(), all.end());
  EXPECT_EQ(all, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7}));
}

TEST(DataSampler, DistributedRejectsBadRank) {
  EXPECT_THROW(DistributedSampler(10, 4, 4), ValueError);
  EXPECT_THROW(DistributedSampler(10, 4, -1), ValueError);
  EXPECT_THROW(DistributedSampler(10, 0, 0), ValueError);
}

}  // namespace
}  // namespace chorus::data

namespace chorus::data {
namespace {

// Evaluation under DDP: every example once over all ranks, no padding, for
// world sizes that do and do not divide the data set (and exceed it).
TEST(DataSampler, ShardsCoverEveryExampleOnce) {
  for (int64_t n : {0, 3, 10, 1001}) {
    for (int64_t replicas : {1, 2, 3, 4, 7}) {
      std::vector<int64_t> all;
      for (int64_t r = 0; r < replicas; ++r) {
        ShardSampler s(n, replicas, r);
        const std::vector<int64_t> mine = s.indices(5);
        EXPECT_EQ(static_cast<int64_t>(mine.size()), s.size());
        EXPECT_LE(s.size(), (n + replicas - 1) / replicas);
        all.insert(all.end(), mine.begin(), mine.end());
      }
      std::sort(all.begin(), all.end());
      std::vector<int64_t> want(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) want[static_cast<size_t>(i)] = i;
      EXPECT_EQ(all, want) << n << " examples on " << replicas << " ranks";
    }
  }
  EXPECT_THROW(ShardSampler(10, 2, 2), ValueError);
}

}  // namespace
}  // namespace chorus::data
