// CollectiveWatch: a process group's flight recorder and watchdog.
//
// Note [Stuck collectives named early]: a collective that waits on a rank
// that died or stopped ends at its timeout (Note [Collective timeouts]), 300
// s by default -- a long time to look at a silent job. So the group tells the
// watch when each collective begins and ends, and a watch thread (waking
// every 50 ms) does two things:
//  - for every collective in flight that has run presence_after (a sixteenth
//    of the timeout, at most 1 s), it marks this rank as arrived in the store,
//    under the key the failure roll call uses (distributed/roll_call.h): the group's
//    name and the collective's sequence number, which every rank counts alike.
//    Collectives that finish sooner -- nearly all -- cost no store traffic;
//  - once the oldest collective in flight has run warn_after (a quarter of the
//    timeout), it looks which ranks have marked themselves (waiting up to
//    presence_after plus 0.5 s for late ones) and prints one line naming the
//    collective, its sequence number and the ranks that have not arrived,
//    while the job still runs.
// Gloo runs one collective at a time (its worker thread); NCCL has many in
// flight on its stream, each begun when issued and ended when the group's
// watchdog sees its event complete, and a CUDA graph's replay is one entry
// (Note [NCCL in a CUDA graph]). Collectives on a stream complete in order, so
// the oldest one in flight is the one that waits: the later ones wait behind
// it, and naming it alone keeps the log to one line per stall.
// It also keeps the last `keep` (20) collectives -- op, bytes, sequence
// number, seconds (from begin to the end seen) -- which the group prints when
// a collective fails, so each surviving rank's log shows what it was doing.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "chorus/distributed/store.h"

namespace chorus::dist {

class CollectiveWatch {
 public:
  CollectiveWatch(StorePtr store, std::string group, std::string backend, int rank, int size,
                  std::chrono::milliseconds timeout, size_t keep = 20);
  ~CollectiveWatch();
  CollectiveWatch(const CollectiveWatch&) = delete;
  CollectiveWatch& operator=(const CollectiveWatch&) = delete;

  // The group's calls around one collective (`seq`: its sequence number in
  // the group, the same on every rank). Several may be in flight; end() of a
  // sequence number not in flight does nothing.
  void begin(const char* op, uint64_t seq, int64_t bytes);
  void end(uint64_t seq);
  // After a failure: whatever is in flight is over (no warning about it later).
  void end_all();

  // The last collectives, oldest first, one line each ("#12 all_reduce 4.0 MB
  // 0.003 s", "running for 2.1 s" for one not finished).
  std::string recent() const;

  std::chrono::milliseconds warn_after() const { return warn_after_; }

  // The job's rank of each member, for the warnings (Note [Ranks named in the
  // job's numbering] in process_group.h); empty: the group's own numbering.
  // Set before the first collective.
  void set_job_ranks(std::vector<int> ranks) { job_ranks_ = std::move(ranks); }

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
  int job_rank(int r) const;

  StorePtr store_;
  std::string group_, backend_;
  int rank_, size_;
  std::chrono::milliseconds timeout_, warn_after_, presence_after_;
  size_t keep_;
  std::vector<int> job_ranks_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  // The collectives in flight and the last finished ones, at most keep_ in
  // all unless more than keep_ are in flight; oldest first.
  std::deque<Entry> log_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace chorus::dist
