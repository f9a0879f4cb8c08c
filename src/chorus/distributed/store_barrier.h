// A barrier through the store, for the moments a process group has no
// collective of its own to use yet (Note [Connected before anyone returns]
// in gloo_group.cpp).
#pragma once

#include <chrono>
#include <string>

#include "chorus/distributed/store.h"

namespace chorus::dist {

// Returns once every rank of [0, size) has called it with the same `name`,
// rank 0 last: the others report through ADD, which the store's server
// answers, before they return, and rank 0 waits for those reports. So when
// rank 0 hosts the store (its TCPStoreServer) and exits right after, no rank
// is still waiting on the server. Throws DistError after `timeout`, naming the
// ranks that never arrived, or the ones that arrived but never reported
// leaving, or saying that the store itself is unreachable. `what` starts the
// message ("gloo: rank 1 of 4").
void store_barrier(Store& store, const std::string& name, int rank, int size, std::chrono::milliseconds timeout,
                   const std::string& what);

}  // namespace chorus::dist
