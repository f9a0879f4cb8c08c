#include "chorus/distributed/roll_call.h"

#include <algorithm>
#include <optional>
#include <string>
#include <thread>

#include "chorus/core/error.h"

namespace chorus::dist {

namespace {
std::string presence_base(const std::string& group, uint64_t seq) {
  return "chorus/failed/" + group + "/" + std::to_string(seq) + "/";
}
std::string failing_key(int job_rank) { return "chorus/failing/" + std::to_string(job_rank); }
}  // namespace

void mark_arrived(Store& store, const std::string& group, int rank, uint64_t seq) {
  try {
    store.set(presence_base(group, seq) + std::to_string(rank), std::string("1"));
  } catch (const std::exception&) {
    // not_arrived will say that the store cannot be reached
  }
}

std::vector<int> roll_call(Store& store, const std::string& group, int rank, int size, uint64_t seq,
                           std::chrono::milliseconds timeout, const StorePtr& job_store, int job_rank) {
  try {
    if (job_store) job_store->set(failing_key(job_rank), std::string("1"));
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

namespace {

std::string rank_list(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out;
}

std::string gave_up_key(int job_rank) { return "chorus/gave-up/" + std::to_string(job_rank); }

// "3,5" <-> {3, 5}: the ranks a failed rank found missing.
std::string join_ranks(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? "," : "") + std::to_string(ranks[i]);
  return out;
}
std::vector<int> split_ranks(const std::string& text) {
  std::vector<int> out;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t comma = std::min(text.find(',', pos), text.size());
    try {
      out.push_back(std::stoi(text.substr(pos, comma - pos)));
    } catch (const std::exception&) {
      // not written by gave_up_key's writer: ignored
    }
    pos = comma + 1;
  }
  return out;
}

}  // namespace

void throw_collective_failure(const std::string& backend, const std::string& op, uint64_t seq, int rank,
                              const std::vector<int>& missing, const std::string& cause,
                              std::chrono::milliseconds timeout, const StorePtr& job_store,
                              const std::vector<int>& job_ranks, const std::string& group) {
  auto in_job = [&](int r) { return job_ranks.empty() ? r : job_ranks.at(static_cast<size_t>(r)); };
  const int me = in_job(rank);
  std::string who;
  if (missing.size() == 1 && missing[0] == -1) {
    who = "the store is unreachable too, so rank 0 (or the launcher hosting it) has probably died";
  } else {
    // Note [Failures that cascade]: the missing ranks that failed first stand
    // for the ranks they found missing.
    std::vector<int> dead, left;
    auto add = [](std::vector<int>& v, int r) {
      if (std::find(v.begin(), v.end(), r) == v.end()) v.push_back(r);
    };
    // A rank that is failing (it began its own roll call) but has not said
    // what it found is waited for, as long as a roll call's grace: both
    // timed out at about the same time (a stopped rank: no connection closes).
    const auto deadline =
        std::chrono::steady_clock::now() + std::min<std::chrono::milliseconds>(timeout, std::chrono::seconds(5));
    for (int g : missing) {
      const int r = in_job(g);
      std::optional<std::string> said;
      try {
        while (job_store && !job_store->check({gave_up_key(r)}) && job_store->check({failing_key(r)}) &&
               std::chrono::steady_clock::now() < deadline)
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        if (job_store && job_store->check({gave_up_key(r)})) said = job_store->get_string(gave_up_key(r));
      } catch (const std::exception&) {
        // the store is going away: name the rank itself
      }
      if (!said) {
        add(dead, r);
        continue;
      }
      add(left, r);
      for (int d : split_ranks(*said)) add(dead, d);
    }
    // A rank that left may have named this one (it timed out waiting for it
    // while this one waited elsewhere), or another that left too.
    std::erase_if(dead, [&](int r) { return r == me || std::find(left.begin(), left.end(), r) != left.end(); });
    std::sort(dead.begin(), dead.end());
    std::sort(left.begin(), left.end());
    try {
      if (job_store) job_store->set(gave_up_key(me), join_ranks(dead));
    } catch (const std::exception&) {
      // as above
    }
    if (missing.empty()) {
      // No rank is missing. Collectives of different sizes are caught before
      // they run (Note [Collective signatures] in gloo_group.cpp), so here one
      // rank ended the group for all (an error or a signal of its own, which its
      // own message names) or the connection between them broke.
      who = "every rank reached it, none is missing: one rank ended the group (stopped by an error or a signal: see "
            "that rank's own message) or a connection between ranks broke";
    } else if (!dead.empty()) {
      who = rank_list(dead) + " did not arrive (dead, stopped, or on another code path)";
      if (!left.empty()) who += "; " + rank_list(left) + " failed first, waiting for " + (dead.size() == 1 ? "it" : "them");
    } else {
      who = rank_list(left) + " did not arrive: " +
            (left.size() == 1 ? "it left first, on a failure of its own (see its message)"
                              : "they left first, on failures of their own (see their messages)");
    }
  }
  CHORUS_THROW(DistError, backend, " ", op, " #", seq, " failed on rank ", me, " (timeout ",
               static_cast<double>(timeout.count()) / 1000.0, " s", group.empty() ? "" : ", group " + group, "): ", who,
               "; cause: ", cause);
}

}  // namespace chorus::dist
