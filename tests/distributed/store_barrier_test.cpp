// dist::store_barrier (Note [Connected before anyone returns] in
// distributed/gloo_group.cpp) over a TCPStore served on 127.0.0.1 (real sockets):
// nobody returns before the last rank arrives, rank 0 returns only after
// every other rank has reported leaving, and a rank that never arrives, or
// arrives and never leaves, is named.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <chorus/chorus.h>
#include <chorus/distributed/store_barrier.h>
#include <chorus/distributed/tcp_store.h>

#include "testing/expect_error.h"

namespace chorus::dist {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::vector<std::string> barrier_keys(const std::string& name, const char* phase, int from, int size) {
  std::vector<std::string> keys;
  for (int r = from; r < size; ++r) keys.push_back("chorus/barrier/" + name + "/" + phase + std::to_string(r));
  return keys;
}

TEST(StoreBarrier, NobodyReturnsBeforeTheLastArrivesAndRankZeroLeavesLast) {
  TCPStoreServer server(0, "127.0.0.1");
  const int size = 4;
  for (int round = 0; round < 3; ++round) {
    const std::string name = "round" + std::to_string(round);
    std::vector<Clock::time_point> returned(size);
    std::atomic<int64_t> last_arrival{0};
    std::atomic<bool> rank0_saw_all_left{false};
    std::vector<std::thread> threads;
    for (int r = 0; r < size; ++r)
      threads.emplace_back([&, r] {
        TCPStore st("127.0.0.1", server.port(), 10s);
        // A different rank arrives late each round, rank 0 included.
        if (r == round + 1 || (round == 2 && r == 0)) std::this_thread::sleep_for(150ms);
        const int64_t arrived = Clock::now().time_since_epoch().count();
        int64_t seen = last_arrival.load();
        while (arrived > seen && !last_arrival.compare_exchange_weak(seen, arrived)) {
        }
        store_barrier(st, name, r, size, 10s, "test rank " + std::to_string(r));
        returned[static_cast<size_t>(r)] = Clock::now();
        if (r == 0) rank0_saw_all_left = st.check(barrier_keys(name, "left/", 1, size));
      });
    for (auto& t : threads) t.join();
    for (int r = 0; r < size; ++r)
      EXPECT_GE(returned[static_cast<size_t>(r)].time_since_epoch().count(), last_arrival.load())
          << "round " << round << ": rank " << r << " returned before the last rank arrived";
    EXPECT_TRUE(rank0_saw_all_left) << "round " << round << ": rank 0 returned before every other rank had left";
  }
}

TEST(StoreBarrier, ARankThatNeverArrivesIsNamed) {
  TCPStoreServer server(0, "127.0.0.1");
  std::vector<std::thread> threads;
  std::vector<std::string> errors(2);
  const auto t0 = Clock::now();
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      TCPStore st("127.0.0.1", server.port(), 10s);
      try {
        store_barrier(st, "never", r, 3, 400ms, "test rank " + std::to_string(r));
      } catch (const DistError& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_LT(Clock::now() - t0, 5s);  // the timeout, not forever
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[static_cast<size_t>(r)].find("test rank " + std::to_string(r) + ": rank(s) 2 did not arrive within 0.4 s"),
              std::string::npos)
        << errors[static_cast<size_t>(r)];
  }
}

TEST(StoreBarrier, ARankThatArrivesButNeverLeavesIsNamedByRankZero) {
  TCPStoreServer server(0, "127.0.0.1");
  TCPStore st0("127.0.0.1", server.port(), 10s), st1("127.0.0.1", server.port(), 10s),
      st2("127.0.0.1", server.port(), 10s);
  st2.set("chorus/barrier/half/arrived/2", std::string("1"));  // rank 2 arrives, then is gone
  std::string error0;
  bool rank1_returned = false;
  std::thread one([&] {
    store_barrier(st1, "half", 1, 3, 400ms, "test rank 1");
    rank1_returned = true;
  });
  try {
    store_barrier(st0, "half", 0, 3, 400ms, "test rank 0");
  } catch (const DistError& e) {
    error0 = e.what();
  }
  one.join();
  EXPECT_TRUE(rank1_returned);
  EXPECT_NE(error0.find("test rank 0: rank(s) 2 arrived but did not finish"), std::string::npos) << error0;
}

TEST(StoreBarrier, OneRankAndBadRanks) {
  TCPStoreServer server(0, "127.0.0.1");
  TCPStore st("127.0.0.1", server.port(), 10s);
  store_barrier(st, "alone", 0, 1, 100ms, "alone");  // returns at once
  EXPECT_TRUE(test::throws_naming([&] { store_barrier(st, "bad", 2, 2, 100ms, "bad"); }, {"rank 2 is out of range for 2"}));
}

}  // namespace
}  // namespace chorus::dist
