#include "chorus/dist/roll_call.h"

#include <algorithm>
#include <thread>

#include "chorus/core/error.h"

namespace chorus::dist {

namespace {
std::string presence_base(const std::string& group, uint64_t seq) {
  return "chorus/failed/" + group + "/" + std::to_string(seq) + "/";
}
}  // namespace

void mark_arrived(Store& store, const std::string& group, int rank, uint64_t seq) {
  try {
    store.set(presence_base(group, seq) + std::to_string(rank), std::string("1"));
  } catch (const std::exception&) {
    // not_arrived will say that the store cannot be reached
  }
}

std::vector<int> roll_call(Store& store, const std::string& group, int rank, int size, uint64_t seq,
                           std::chrono::milliseconds timeout) {
  try {
    store.set(presence_base(group, seq) + std::to_string(rank), std::string("1"));
  } catch (const std::exception&) {
    return {-1};
  }
  return not_arrived(store, group, rank, size, seq, std::min<std::chrono::milliseconds>(timeout, std::chrono::seconds(5)));
}

std::vector<int> not_arrived(Store& store, const std::string& group, int rank, int size, uint64_t seq,
                             std::chrono::milliseconds grace) {
  const std::string base = presence_base(group, seq);
  try {
    const auto deadline = std::chrono::steady_clock::now() + grace;
    std::vector<int> missing;
    for (;;) {
      missing.clear();
      for (int r = 0; r < size; ++r)
        if (r != rank && !store.check({base + std::to_string(r)})) missing.push_back(r);
      if (missing.empty() || std::chrono::steady_clock::now() >= deadline) return missing;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  } catch (const std::exception&) {
    return {-1};
  }
}

void throw_collective_failure(const std::string& backend, const std::string& op, uint64_t seq, int rank,
                              const std::vector<int>& missing, const std::string& cause,
                              std::chrono::milliseconds timeout, const StorePtr& store) {
  std::string who;
  if (missing.size() == 1 && missing[0] == -1) {
    who = "the store is unreachable too, so rank 0 (or the launcher hosting it) has probably died";
  } else if (missing.empty()) {
    // No rank is missing. Collectives of different sizes are caught before
    // they run (Note [Collective signatures] in gloo_group.cpp), so here one
    // rank ended the group for all (an error or a signal of its own, which its
    // own message names) or the connection between them broke.
    who = "every rank reached it, none is missing: one rank ended the group (stopped by an error or a signal: see "
          "that rank's own message) or a connection between ranks broke";
  } else {
    who = missing.size() == 1 ? "rank " : "ranks ";
    for (size_t i = 0; i < missing.size(); ++i) who += (i ? ", " : "") + std::to_string(missing[i]);
    who += missing.size() == 1 ? " did not arrive" : " did not arrive";
    who += " (dead, stopped, or on another code path)";
  }
  (void)store;
  CHORUS_THROW(DistError, backend, " ", op, " #", seq, " failed on rank ", rank, " (timeout ",
               static_cast<double>(timeout.count()) / 1000.0, " s): ", who, "; cause: ", cause);
}

}  // namespace chorus::dist
