// CollectiveWatch: a process group's flight recorder and watchdog.
//
// Note [Stuck collectives named early]: a collective that waits on a rank
// that died or stopped ends at its timeout (Note [Collective timeouts]), 300
// s by default -- a long time to look at a silent job. So the group's worker
// tells the watch when each collective begins and ends, and a watch thread
// (waking every 50 ms) does two things for the one in flight:
//  - once it has run presence_after (a quarter of warn_after, at most 1 s), it
//    marks this rank as arrived in the store, under the key the failure roll
//    call uses (dist/roll_call.h). Collectives that finish sooner -- nearly
//    all -- cost no store traffic;
//  - once it has run warn_after (a quarter of the timeout), it looks which
//    ranks have marked themselves (waiting up to presence_after plus 0.5 s
//    for late ones) and prints one line naming the collective, its sequence
//    number and the ranks that have not arrived, while the job still runs.
// It also keeps the last `keep` (20) collectives -- op, bytes, sequence
// number, seconds -- which the group prints when a collective fails, so each
// surviving rank's log shows what it was doing.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>

#include "chorus/dist/store.h"

namespace chorus::dist {

class CollectiveWatch {
 public:
  CollectiveWatch(StorePtr store, std::string group, std::string backend, int rank, int size,
                  std::chrono::milliseconds timeout, size_t keep = 20);
  ~CollectiveWatch();
  CollectiveWatch(const CollectiveWatch&) = delete;
  CollectiveWatch& operator=(const CollectiveWatch&) = delete;

  // The worker's calls around one collective.
  void begin(const char* op, uint64_t seq, int64_t bytes);
  void end(uint64_t seq);

  // The last collectives, oldest first, one line each ("#12 all_reduce 4.0 MB
  // 0.003 s", "running for 2.1 s" for one not finished).
  std::string recent() const;

  std::chrono::milliseconds warn_after() const { return warn_after_; }

 private:
  struct Entry {
    std::string op;
    uint64_t seq = 0;
    int64_t bytes = 0;
    std::chrono::steady_clock::time_point start;
    double seconds = -1;  // -1 while running
    bool marked = false, warned = false;
  };
  void watch();
  void warn(const Entry& e);

  StorePtr store_;
  std::string group_, backend_;
  int rank_, size_;
  std::chrono::milliseconds timeout_, warn_after_, presence_after_;
  size_t keep_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Entry> log_;  // the last keep_ collectives; the back one may be running
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace chorus::dist
