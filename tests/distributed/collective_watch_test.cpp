// dist::CollectiveWatch (Note [Stuck collectives named early]) with several
// collectives in flight at once, as the NCCL group has them: the watches of
// two ranks of a three-rank group share a TCPStore served on 127.0.0.1 (real
// sockets); the third rank never arrives. Each must name it, once, for the
// oldest collective in flight, mark itself present for every collective
// that stays in flight and for none that finished quickly, and keep its
// flight recorder (in-flight entries kept, finished ones pruned oldest
// first, ends out of order).
#include <gtest/gtest.h>

#include <chrono>
#include <iterator>
#include <memory>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include <chorus/chorus.h>
#include <chorus/distributed/collective_watch.h>
#include <chorus/distributed/hash_store.h>
#include <chorus/distributed/roll_call.h>
#include <chorus/distributed/tcp_store.h>

namespace chorus::dist {
namespace {

using namespace std::chrono_literals;

int count(const std::string& text, const std::regex& re) {
  return static_cast<int>(std::distance(std::sregex_iterator(text.begin(), text.end(), re), std::sregex_iterator()));
}

TEST(CollectiveWatch, SeveralInFlightNameTheMissingRankOnceForTheOldest) {
  TCPStoreServer server(0, "127.0.0.1");
  const int size = 3;  // rank 2 never arrives
  // A 2 s timeout: marks after 125 ms in flight, warns after 500 ms.
  const auto timeout = 2000ms;
  std::string err;
  int quick = 0;
  {
    std::vector<std::unique_ptr<CollectiveWatch>> watches;
    for (int r = 0; r < 2; ++r)
      watches.push_back(std::make_unique<CollectiveWatch>(
          std::make_shared<TCPStore>("127.0.0.1", server.port(), 10s), "g", "nccl", r, size, timeout));
    ::testing::internal::CaptureStderr();
    // Random sizes and a random number of quick collectives before the stall.
    std::mt19937 rng(std::random_device{}());
    quick = 2 + static_cast<int>(rng() % 4);
    std::vector<int64_t> bytes;
    for (int i = 0; i < quick + 3; ++i) bytes.push_back(1 + static_cast<int64_t>(rng() % (8 << 20)));
    for (auto& w : watches) {
      // Several in flight, ended in another order than begun.
      for (int s = 1; s <= quick; ++s) w->begin("all_reduce", s, bytes[s - 1]);
      for (int s = quick; s >= 1; --s) w->end(s);
      // The stall: three in flight; the oldest is the one that waits.
      for (int s = quick + 1; s <= quick + 3; ++s) w->begin(s == quick + 2 ? "all_gather" : "all_reduce", s, bytes[s - 1]);
    }
    std::this_thread::sleep_for(1500ms);  // past warn_after plus the grace for late marks
    // Presence: every collective that stayed in flight, on both ranks; none of the quick ones.
    TCPStore probe("127.0.0.1", server.port(), 10s);
    for (int s = quick + 1; s <= quick + 3; ++s)
      EXPECT_TRUE(not_arrived(probe, "g", 2, size, s, 0ms).empty()) << "#" << s << " not marked by both ranks";
    for (int s = 1; s <= quick; ++s)
      EXPECT_EQ(not_arrived(probe, "g", 2, size, s, 0ms), (std::vector<int>{0, 1})) << "#" << s << " finished at once";
    const std::string rec = watches[0]->recent();
    for (int s = 1; s <= quick + 3; ++s)
      EXPECT_NE(rec.find("#" + std::to_string(s) + " "), std::string::npos) << rec;
    EXPECT_EQ(count(rec, std::regex("running for")), 3) << rec;
    watches.clear();  // joins the watch threads
    err = ::testing::internal::GetCapturedStderr();
  }
  // One line per rank, for the oldest in flight, naming rank 2 alone.
  for (int r = 0; r < 2; ++r) {
    const std::regex line("chorus: rank " + std::to_string(r) +
                          ": nccl all_reduce #([0-9]+) \\([0-9.]+ (B|kB|MB)\\) has waited [0-9.]+ s of its 2 s timeout: "
                          "rank 2 has not arrived");
    std::smatch m;
    ASSERT_TRUE(std::regex_search(err, m, line)) << err;
    EXPECT_EQ(m[1].str(), std::to_string(quick + 1)) << err;
    EXPECT_EQ(count(err, std::regex("chorus: rank " + std::to_string(r) + ": ")), 1) << err;
  }
  EXPECT_EQ(err.find("all_gather"), std::string::npos) << "only the oldest in flight is named: " << err;
}

TEST(CollectiveWatch, FlightRecorderKeepsInFlightAndPrunesFinishedOldestFirst) {
  auto store = std::make_shared<HashStore>(5s);
  CollectiveWatch w(store, "g", "nccl", 0, 2, 300s, 4);
  w.begin("all_reduce", 1, 4096);  // stays in flight
  w.begin("broadcast", 2, 100);    // stays in flight
  for (int s = 3; s <= 12; ++s) {
    w.begin("all_reduce", s, 2 << 20);
    w.end(s);
  }
  w.end(99);  // not in flight: nothing
  std::string rec = w.recent();
  // Oldest first: the two in flight, then the last two finished.
  std::regex lines("  #1 all_reduce 4.0 kB running for [0-9.]+ s\n  #2 broadcast 100 B running for [0-9.]+ s\n"
                   "  #11 all_reduce 2.0 MB [0-9.]+ s\n  #12 all_reduce 2.0 MB [0-9.]+ s\n");
  EXPECT_TRUE(std::regex_match(rec, lines)) << rec;
  w.end(2);  // out of order
  w.begin("all_reduce", 13, 1);
  rec = w.recent();
  EXPECT_TRUE(std::regex_match(rec, std::regex("  #1 all_reduce 4.0 kB running for [0-9.]+ s\n  #11 .*\n  #12 .*\n"
                                               "  #13 all_reduce 1 B running for [0-9.]+ s\n")))
      << rec;
  w.end_all();
  EXPECT_EQ(w.recent().find("running"), std::string::npos) << w.recent();
}

// Note [Ranks named in the job's numbering] and Note [Failures that cascade]:
// a 2 x 2 mesh (tp groups {0,1} {2,3}, dp groups {0,2} {1,3}) whose victim,
// drawn at random, dies. Its tp peer fails first, naming it by its job rank;
// that peer's dp partner then finds the peer missing, and must name the
// victim, not the peer that only left.
std::string failure_message(int rank, const std::vector<int>& missing, const StorePtr& job,
                            const std::vector<int>& job_ranks, const std::string& group) {
  try {
    throw_collective_failure("gloo", "all_reduce", 7, rank, missing, "Connection closed by peer", 4000ms, job,
                             job_ranks, group);
  } catch (const DistError& e) {
    return e.message();
  }
  return "";
}

TEST(RollCall, FailuresNameJobRanksAndTheRankACascadeBeganAt) {
  std::mt19937 rng(std::random_device{}());
  for (int victim = 0; victim < 4; ++victim) {
    auto job = std::make_shared<HashStore>(5s);
    const int peer = victim ^ 1;     // its tp partner (tp groups are consecutive ranks)
    const int partner = peer ^ 2;    // the peer's dp partner
    const std::vector<int> tp = {peer & ~1, (peer & ~1) + 1}, dp = {peer & 1, (peer & 1) + 2};
    const std::string first = failure_message(peer & 1, {victim & 1}, job, tp, "default/tp2");
    EXPECT_NE(first.find("failed on rank " + std::to_string(peer) + " (timeout 4 s, group default/tp2): rank " +
                         std::to_string(victim) + " did not arrive (dead"), std::string::npos) << first;
    // The partner, in the dp group, sees the peer (dp rank peer >> 1) missing.
    const std::string second = failure_message(partner >> 1, {peer >> 1}, job, dp, "default/dp1");
    EXPECT_NE(second.find("failed on rank " + std::to_string(partner) + " (timeout 4 s, group default/dp1): rank " +
                          std::to_string(victim) + " did not arrive (dead, stopped, or on another code path); rank " +
                          std::to_string(peer) + " failed first, waiting for it"), std::string::npos) << second;
    // The job's own group (no job ranks): the numbering is the group's, no group named.
    const int other = static_cast<int>(rng() % 3);  // a missing rank of a fresh job that recorded nothing
    const std::string plain = failure_message(3, {other}, std::make_shared<HashStore>(5s), {}, "");
    EXPECT_NE(plain.find("failed on rank 3 (timeout 4 s): rank " + std::to_string(other) + " did not arrive"),
              std::string::npos) << plain;
  }
  // A rank that left after naming this one (it timed out waiting for it):
  // this rank is alive, so the one that left is named as having failed first.
  auto job = std::make_shared<HashStore>(5s);
  job->set("chorus/gave-up/1", std::string("0"));
  const std::string msg = failure_message(0, {1}, job, {}, "");
  EXPECT_NE(msg.find("rank 1 did not arrive: it left first, on a failure of its own"), std::string::npos) << msg;
  EXPECT_EQ(job->get_string("chorus/gave-up/0"), "") << "this rank's own record: it found no dead rank";
}

TEST(RollCall, AFailingRankIsWaitedForADeadOneIsNot) {
  // Rank 1 began failing (its roll call runs) and says, a moment later, that
  // rank 3 was missing: rank 0, which found rank 1 missing, names rank 3.
  auto job = std::make_shared<HashStore>(5s);
  const std::vector<int> none = roll_call(*job, "g", 1, 2, 4, 200ms, job, 1);  // rank 0 never marks itself
  EXPECT_EQ(none, std::vector<int>{0});
  std::thread later([&] {
    std::this_thread::sleep_for(300ms);
    job->set("chorus/gave-up/1", std::string("3"));
  });
  auto t0 = std::chrono::steady_clock::now();
  const std::string msg = failure_message(0, {1}, job, {}, "");
  later.join();
  EXPECT_NE(msg.find("rank 3 did not arrive (dead, stopped, or on another code path); rank 1 failed first"),
            std::string::npos) << msg;
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 250ms);
  // Rank 2 never began failing (dead): named at once, no wait.
  t0 = std::chrono::steady_clock::now();
  const std::string dead = failure_message(0, {2}, job, {}, "");
  EXPECT_NE(dead.find("rank 2 did not arrive (dead"), std::string::npos) << dead;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
}

}  // namespace
}  // namespace chorus::dist
