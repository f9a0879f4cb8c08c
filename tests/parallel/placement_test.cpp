// parallel::place and the balance helpers (issue 13, item 1): layers land on
// the devices the balance names, bad balances are one clear ValueError, and
// balance_by_cost is the exact minimum of the slowest part (checked against
// every contiguous split).
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <numeric>
#include <random>

#include "chorus/chorus.h"
#include "chorus/parallel/placement.h"
#include "testing/expect_error.h"

namespace chorus::parallel {
namespace {

std::shared_ptr<nn::Sequential> net() {
  manual_seed(1);
  return std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
      std::make_shared<nn::Linear>(6, 8), std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(8, 8),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(8, 3)});
}

TEST(PlaceSequential, PlaceMovesEachPartToItsDeviceAndTheModelRunsThere) {
  auto seq = net();
  place(*seq, {2, 3}, {Device("cpu:0"), Device("cpu:1")});
  EXPECT_EQ(std::static_pointer_cast<nn::Linear>((*seq)[0])->weight().device(), Device("cpu:0"));
  EXPECT_EQ(std::static_pointer_cast<nn::Linear>((*seq)[2])->weight().device(), Device("cpu:1"));
  EXPECT_EQ(std::static_pointer_cast<nn::Linear>((*seq)[4])->weight().device(), Device("cpu:1"));
  EXPECT_EQ(seq->forward(randn({4, 6})).device(), Device("cpu:1"));
}

TEST(PlaceSequential, BadBalancesAreClearErrors) {
  auto seq = net();
  const std::vector<Device> two{Device("cpu:0"), Device("cpu:1")};
  EXPECT_TRUE(test::throws_naming([&] { place(*seq, {2, 2}, two); }, {"2,2", "adds up to 4", "5"}));
  EXPECT_TRUE(test::throws_naming([&] { place(*seq, {1, 1, 1, 1, 1, 1}, {Device("cpu:0")}); }, {"6 parts", "1 devices"}));
  EXPECT_TRUE(test::throws_naming([&] { place(*seq, {5, 0}, two); }, {"part 1", "at least one"}));
  std::vector<Device> six(6, Device("cpu:0"));
  EXPECT_TRUE(test::throws_naming([&] { place(*seq, {1, 1, 1, 1, 1, 0}, six); }, {"6 parts", "only 5 layers"}));
  EXPECT_THROW(place(*seq, {2, 3}, {Device("cpu:0"), Device("cpu:99")}), Error);
}

double slowest(const std::vector<double>& costs, const std::vector<int64_t>& balance) {
  double worst = 0;
  size_t i = 0;
  for (int64_t part : balance) {
    double s = 0;
    for (int64_t k = 0; k < part; ++k) s += costs[i++];
    worst = std::max(worst, s);
  }
  return worst;
}

TEST(PlaceSequential, BalanceByCostIsTheExactMinimumOfTheSlowestPart) {
  EXPECT_EQ(balance_by_cost({1, 1, 1, 1, 4}, 2), (std::vector<int64_t>{4, 1}));
  EXPECT_EQ(balance_by_cost({5, 1, 1, 1, 1, 1}, 2), (std::vector<int64_t>{1, 5}));
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(0.1, 3.0);
  for (int trial = 0; trial < 30; ++trial) {
    const int n = 3 + trial % 7, parts = 1 + trial % 3;
    std::vector<double> costs(n);
    for (double& c : costs) c = u(rng);
    const std::vector<int64_t> got = balance_by_cost(costs, parts);
    ASSERT_EQ(static_cast<int64_t>(got.size()), parts);
    EXPECT_EQ(std::accumulate(got.begin(), got.end(), int64_t{0}), n);
    // Every contiguous split into `parts` non-empty parts, by brute force.
    double best = std::numeric_limits<double>::infinity();
    std::vector<int64_t> b(parts);
    std::function<void(int, int)> go = [&](int p, int left) {
      if (p == parts - 1) {
        if (left < 1) return;
        b[p] = left;
        best = std::min(best, slowest(costs, b));
        return;
      }
      for (int k = 1; k <= left - (parts - 1 - p); ++k) b[p] = k, go(p + 1, left - k);
    };
    go(0, n);
    EXPECT_DOUBLE_EQ(slowest(costs, got), best) << "trial " << trial;
  }
  EXPECT_THROW(balance_by_cost({1, 2}, 3), ValueError);
}

TEST(PlaceSequential, BalanceByTimeGivesAValidSplit) {
  auto seq = net();
  const std::vector<int64_t> b = balance_by_time(*seq, randn({16, 6}), 2, 2);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_EQ(b[0] + b[1], 5);
  EXPECT_GE(b[0], 1);
  EXPECT_GE(b[1], 1);
}

TEST(PlaceSequential, BalanceByMemoryGivesTheHeavyLayerAPartOfItsOwn) {
  manual_seed(2);
  // Layer 2 holds 4 MiB of weights (8 with its gradient), layer 4 1 MiB,
  // the rest a few KiB: the most even memory split gives layer 2 a part
  // shared with no other weighty layer.
  auto seq = std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
      std::make_shared<nn::Linear>(6, 16), std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(16, 65536),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(65536, 4), std::make_shared<nn::ReLU>(),
      std::make_shared<nn::Linear>(4, 3)});
  const std::vector<int64_t> b = balance_by_memory(*seq, randn({2, 6}), 3);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0] + b[1] + b[2], 7);
  int64_t start = 0;
  size_t part = 0;
  while (start + b[part] <= 2) start += b[part++];
  const int64_t end = start + b[part];  // layer 2's part is [start, end)
  EXPECT_GE(start, 1) << b[0] << "," << b[1] << "," << b[2];
  EXPECT_LE(end, 4) << b[0] << "," << b[1] << "," << b[2];
}

}  // namespace
}  // namespace chorus::parallel
