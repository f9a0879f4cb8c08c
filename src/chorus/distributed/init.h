// init_process_group: one call that turns a process started by a launcher
// (chorus launch, torchrun, mpirun, srun) into a rank of a process group.
//
//   auto env = dist::read_launch_env();         // nullopt when not launched
//   auto pg = dist::init_process_group();       // backend from the device
//   pg->all_reduce(t)->wait();
#pragma once

#include <chrono>
#include <optional>
#include <string>

#include "chorus/distributed/launch_env.h"
#include "chorus/distributed/process_group.h"

namespace chorus::dist {

struct InitOptions {
  std::string backend = "gloo";  // "gloo" (CPU tensors) or "nccl" (CUDA tensors)
  std::chrono::milliseconds timeout = std::chrono::seconds(300);  // rendezvous and every collective
};

// Throws DistError with how to launch when no launcher environment is set,
// and the rendezvous errors of rendezvous.h. The group keeps the store (and
// on rank 0, its server) alive.
ProcessGroupPtr init_process_group(const InitOptions& options = {});
// The same for an explicit environment (tests, tools).
ProcessGroupPtr init_process_group(const LaunchEnv& env, const InitOptions& options);

// The local address this machine uses to reach `host` (the route's source
// address), which the other ranks can connect back to.
std::string local_address_towards(const std::string& host, int port);

}  // namespace chorus::dist
