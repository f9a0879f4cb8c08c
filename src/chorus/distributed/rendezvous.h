// Rendezvous: how the processes of a job find each other's store and check in.
#pragma once

#include <chrono>
#include <memory>

#include "chorus/distributed/launch_env.h"
#include "chorus/distributed/store.h"
#include "chorus/distributed/tcp_store.h"

namespace chorus::dist {

struct Rendezvous {
  StorePtr store;                          // this job's namespace of the store
  std::shared_ptr<TCPStoreServer> server;  // set on the rank that hosts it
};

// Connects to (or, on rank 0 when no launcher serves one, hosts) the TCP
// store at MASTER_ADDR:MASTER_PORT and checks in. Each failure is one
// DistError: the master unreachable (address, how long), the port taken,
// world sizes that disagree, a rank that joins twice, ranks that never come
// (named) within `timeout`.
Rendezvous rendezvous(const LaunchEnv& env, std::chrono::milliseconds timeout);

}  // namespace chorus::dist
