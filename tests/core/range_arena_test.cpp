// RangeArena (core/range_arena.h): best fit, splitting, merging only within a
// segment and a stream's key (Note [Free ranges by stream]), and a random
// sequence of takes and gives checked against a shadow list of live blocks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "chorus/core/error.h"
#include "chorus/core/range_arena.h"

namespace chorus::detail {
namespace {

int key_a, key_b;  // two streams' keys
const RangeArena::Key A = &key_a, B = &key_b;

TEST(RangeArena, TakesTheSmallestRangeThatFitsAndSplitsIt) {
  RangeArena arena;
  arena.add_segment(0x10000, 1000, A);
  arena.add_segment(0x20000, 300, A);
  auto t = arena.take(250, A);
  ASSERT_TRUE(t);
  EXPECT_EQ(t->addr, 0x20000u);  // 300 fits better than 1000
  EXPECT_EQ(t->size, 250u);
  EXPECT_EQ(arena.free_bytes(), 1050u);
  auto u = arena.take(60, A);  // the 50-byte remainder is too small: from the 1000
  ASSERT_TRUE(u);
  EXPECT_EQ(u->addr, 0x10000u);
  EXPECT_FALSE(arena.take(941, A));
  EXPECT_FALSE(arena.take(10, B));  // no range of B's
  arena.give(t->addr, t->size, A);
  arena.give(u->addr, u->size, A);
  EXPECT_EQ(arena.free_ranges(), 2u);  // each segment whole again
  EXPECT_EQ(arena.largest_free(A), 1000u);
}

TEST(RangeArena, SmallRemaindersGoWithTheBlock) {
  RangeArena arena(64);
  arena.add_segment(4096, 1000, A);
  auto t = arena.take(960, A);
  ASSERT_TRUE(t);
  EXPECT_EQ(t->size, 1000u);  // 40 left would be under 64
  EXPECT_EQ(arena.free_bytes(), 0u);
  arena.give(t->addr, t->size, A);
  EXPECT_EQ(arena.free_bytes(), 1000u);
}

TEST(RangeArena, MergesOnlyWithinASegmentAndAKey) {
  RangeArena arena;
  // Two segments adjacent in address space: never one range.
  arena.add_segment(1000, 100, A);
  arena.add_segment(1100, 100, A);
  EXPECT_EQ(arena.largest_free(A), 100u);
  auto x = arena.take(100, A), y = arena.take(100, A);
  ASSERT_TRUE(x && y);
  arena.give(x->addr, 100, A);
  arena.give(y->addr, 100, A);
  EXPECT_EQ(arena.free_ranges(), 2u);
  EXPECT_EQ(arena.largest_free(A), 100u);

  // One segment: neighbours freed on another stream stay apart until the
  // same key frees them.
  RangeArena one;
  one.add_segment(0, 300, A);
  auto p = one.take(100, A), q = one.take(100, A), r = one.take(100, A);
  ASSERT_TRUE(p && q && r);
  one.give(q->addr, 100, B);
  one.give(p->addr, 100, A);
  one.give(r->addr, 100, A);
  EXPECT_EQ(one.free_ranges(), 3u);
  EXPECT_EQ(one.largest_free(A), 100u);
  EXPECT_EQ(one.largest_free(B), 100u);
  auto q2 = one.take(100, B);
  ASSERT_TRUE(q2);
  EXPECT_EQ(q2->addr, q->addr);
  one.give(q2->addr, 100, A);  // now all A's: one range
  EXPECT_EQ(one.free_ranges(), 1u);
  EXPECT_EQ(one.largest_free(A), 300u);
}

TEST(RangeArena, RefusesOverlapsAndDoubleFrees) {
  RangeArena arena;
  arena.add_segment(1000, 100, A);
  EXPECT_THROW(arena.add_segment(1050, 100, A), Error);
  EXPECT_THROW(arena.add_segment(950, 51, A), Error);
  auto t = arena.take(40, A);
  ASSERT_TRUE(t);
  EXPECT_THROW(arena.give(t->addr + 40, 10, A), Error);  // still free
  arena.give(t->addr, 40, A);
  EXPECT_THROW(arena.give(t->addr, 40, A), Error);
  EXPECT_THROW(arena.give(5000, 10, A), Error);  // in no segment
}

// Random takes and gives on two keys: live blocks never overlap and stay in
// their segments, the bytes add up, and once everything is given back on one
// key every segment is one range again.
TEST(RangeArena, RandomTakesAndGivesKeepTheBooks) {
  std::mt19937_64 rng(20261129);
  RangeArena arena(64);
  struct Seg { uintptr_t base; size_t size; };
  std::vector<Seg> segs;
  uintptr_t next_base = 1 << 20;
  struct Live { uintptr_t addr; size_t size; };
  std::vector<Live> live;
  size_t live_bytes = 0;
  for (int step = 0; step < 20000; ++step) {
    const RangeArena::Key key = rng() % 3 ? A : B;
    if (live.empty() || rng() % 2) {
      const size_t want = 1 + rng() % 5000;
      auto t = arena.take(want, key);
      if (!t) {
        if (rng() % 4) continue;
        const size_t size = want + rng() % 20000;
        // Sometimes right after the previous segment, as cudaMalloc may place it.
        segs.push_back({next_base, size});
        arena.add_segment(next_base, size, key);
        next_base += size + (rng() % 2 ? 0 : 4096);
        t = arena.take(want, key);
        ASSERT_TRUE(t);
      }
      ASSERT_GE(t->size, want);
      ASSERT_LT(t->size, want + 64);
      live.push_back({t->addr, t->size});
      live_bytes += t->size;
    } else {
      const size_t i = rng() % live.size();
      arena.give(live[i].addr, live[i].size, key);
      live_bytes -= live[i].size;
      live[i] = live.back();
      live.pop_back();
    }
    ASSERT_EQ(arena.free_bytes() + live_bytes, arena.segment_bytes());
    if (step % 500 == 0) {
      std::vector<Live> sorted = live;
      std::sort(sorted.begin(), sorted.end(), [](const Live& x, const Live& y) { return x.addr < y.addr; });
      for (size_t j = 0; j < sorted.size(); ++j) {
        if (j > 0) ASSERT_LE(sorted[j - 1].addr + sorted[j - 1].size, sorted[j].addr);
        const auto seg = std::find_if(segs.begin(), segs.end(), [&](const Seg& s) {
          return s.base <= sorted[j].addr && sorted[j].addr < s.base + s.size;
        });
        ASSERT_NE(seg, segs.end());
        ASSERT_LE(sorted[j].addr + sorted[j].size, seg->base + seg->size);
      }
    }
  }
  ASSERT_GT(segs.size(), 3u);
  for (const Live& l : live) arena.give(l.addr, l.size, A);
  // B's free ranges stay B's; take them (they merge with nothing) and give them to A.
  while (arena.largest_free(B) > 0) {
    auto t = arena.take(arena.largest_free(B), B);
    ASSERT_TRUE(t);
    arena.give(t->addr, t->size, A);
  }
  EXPECT_EQ(arena.free_bytes(), arena.segment_bytes());
  EXPECT_EQ(arena.free_ranges(), segs.size());
}

}  // namespace
}  // namespace chorus::detail
