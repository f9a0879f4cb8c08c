#include "chorus/distributed/init.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <thread>

#include "chorus/core/device.h"
#include "chorus/core/error.h"
#include "chorus/distributed/rendezvous.h"
#include "chorus/ops/threads.h"

namespace chorus::dist {

std::string local_address_towards(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res) return "127.0.0.1";
  std::string out = "127.0.0.1";
  // A UDP "connect" sends nothing; it only picks the route and its source address.
  int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd >= 0 && ::connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
    sockaddr_in local{};
    socklen_t len = sizeof(local);
    char buf[INET_ADDRSTRLEN];
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
        ::inet_ntop(AF_INET, &local.sin_addr, buf, sizeof(buf)))
      out = buf;
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(res);
  return out;
}

namespace {

// Note [Cores shared by local ranks]
// Each process's CPU ops use every hardware thread by default. With several
// ranks on one machine training on the CPU (Gloo), each took all the cores:
// 2 ranks on 2 cores ran 4 compute threads plus OpenBLAS's, and the 2-rank
// Fashion-MNIST CNN trained at 2391 img/s; with the cores shared (1 thread
// each) at 2854, +19%, same losses. So a Gloo group gives each of the
// LOCAL_WORLD_SIZE ranks on a machine its share of the cores, as torchrun
// sets OMP_NUM_THREADS=1 for its workers; CHORUS_NUM_THREADS, when set,
// always wins. NCCL ranks compute on their GPU and are left alone.
void share_cores_among_local_ranks(const LaunchEnv& env) {
  if (cpu_threads_from_environment() || env.local_world_size <= 1) return;
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  set_cpu_threads(std::max(1, cores / env.local_world_size));
}

}  // namespace

ProcessGroupPtr init_process_group(const LaunchEnv& env, const InitOptions& options) {
  if (options.backend == "gloo") share_cores_among_local_ranks(env);
  if (options.backend == "nccl") {
    // One GPU per process: LOCAL_RANK's (as torchrun's users set it).
    const int n = cuda_device_count();
    CHORUS_CHECK_T(DistError, n > 0, "init_process_group: the nccl backend needs a CUDA GPU and this machine has none");
    CHORUS_CHECK_T(DistError, env.local_rank < n, "init_process_group: local rank ", env.local_rank, " needs cuda:",
                   env.local_rank, " but this machine has ", n, " GPU(s): start at most ", n,
                   " processes per node (--nproc-per-node gpu)");
    set_device(cuda_device(env.local_rank));
  }
  Rendezvous rdzv = rendezvous(env, options.timeout);
  ProcessGroupOptions po;
  po.timeout = options.timeout;
  po.local_addr = local_address_towards(env.master_addr, env.master_port);
  ProcessGroupPtr pg = make_process_group(options.backend, env.rank, env.world_size, rdzv.store, po);
  // The store lives in rank 0 (unless a launcher serves it) and must not go
  // away while other ranks still talk to it: every rank checks out when its
  // group is released, and the host waits for all of them (30 s at most)
  // before stopping the server.
  auto server = rdzv.server;
  auto store = rdzv.store;
  const int world = env.world_size;
  ProcessGroup* raw = pg.get();
  return ProcessGroupPtr(raw, [pg, server, store, world](ProcessGroup*) mutable {
    try {
      store->add("exit", 1);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (server && std::chrono::steady_clock::now() < deadline) {
        if (store->add("exit", 0) >= world) break;
        ::usleep(5000);
      }
    } catch (const std::exception&) {
      // The store is gone (its host exited): nothing left to wait for.
    }
    pg.reset();
    server.reset();
  });
}

ProcessGroupPtr init_process_group(const InitOptions& options) {
  std::optional<LaunchEnv> env = read_launch_env();
  CHORUS_CHECK_T(DistError, env.has_value(),
                 "init_process_group: this process was not started by a launcher (no RANK / WORLD_SIZE, "
                 "OMPI_COMM_WORLD_*, or SLURM_PROCID in the environment); start it with "
                 "`chorus launch --nproc-per-node N -- PROGRAM ...`, torchrun, mpirun or srun");
  return init_process_group(*env, options);
}

}  // namespace chorus::dist
