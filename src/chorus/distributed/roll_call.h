// After a collective failed (Note [Collective timeouts] in process_group.h):
// which ranks did not arrive, found through the store, and the one DistError
// that says so.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "chorus/distributed/store.h"

namespace chorus::dist {

// Writes this rank's presence under (group, seq) and waits up to
// min(timeout, 5 s) for the others'; returns the ranks that never wrote. If
// the store itself cannot be reached, returns {-1}.
// With `job_store`, it first records in it that this rank (`job_rank`) is
// failing (Note [Failures that cascade] in process_group.h).
std::vector<int> roll_call(Store& store, const std::string& group, int rank, int size, uint64_t seq,
                           std::chrono::milliseconds timeout, const StorePtr& job_store = nullptr, int job_rank = -1);

// The two halves of a roll call, for the watchdog that names a missing rank
// before the timeout (Note [Stuck collectives named early] in
// collective_watch.h): this rank's presence at (group, seq), and the ranks
// whose presence has not appeared within `grace` ({-1}: the store cannot be
// reached).
void mark_arrived(Store& store, const std::string& group, int rank, uint64_t seq);
std::vector<int> not_arrived(Store& store, const std::string& group, int rank, int size, uint64_t seq,
                             std::chrono::milliseconds grace);

// DistError: "<backend> <op> #<seq> failed on rank R (timeout T s): ranks A, B
// did not arrive (dead, stopped, or on another code path); cause: ...".
// `rank` and `missing` are the group's ranks; the message names the job's
// (`job_ranks`: the job rank of each member, empty for the job's own group;
// Note [Ranks named in the job's numbering] in process_group.h). `job_store`
// (the store every group of the job shares) holds the ranks' failures (Note
// [Failures that cascade]): a missing rank that failed itself is replaced by
// the ranks it found missing, and this rank's own failure is recorded.
// `group`: the group's name, given in the message for a subgroup.
[[noreturn]] void throw_collective_failure(const std::string& backend, const std::string& op, uint64_t seq, int rank,
                                           const std::vector<int>& missing, const std::string& cause,
                                           std::chrono::milliseconds timeout, const StorePtr& job_store,
                                           const std::vector<int>& job_ranks = {}, const std::string& group = {});

}  // namespace chorus::dist
