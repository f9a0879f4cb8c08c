// `chorus devices` and `chorus --version`.
#include "commands.h"

#include <cstdio>

#include "chorus/core/backend.h"
#include "chorus/core/device.h"
#include "chorus/core/error.h"
#include "chorus/distributed/launch_env.h"
#include "chorus/distributed/process_group.h"

#include <optional>
#include <string>
#ifdef CHORUS_WITH_CUDA
#include "chorus/cuda/runtime/info.h"
#endif

namespace chorus::app {

std::string version_text() {
  std::string s = std::string("chorus ") + CHORUS_VERSION + "\n";
#ifdef CHORUS_WITH_CUDA
  s += cuda::build_info();
#else
  s += "CUDA: no\ncuDNN: no\nNCCL: no\nCUPTI: no\n";
#endif
#ifdef CHORUS_WITH_GLOO
  s += std::string("Gloo: ") + CHORUS_GLOO_VERSION + " (process groups on CPU tensors)\n";
#else
  s += "Gloo: no (no CPU process groups; install Debian's libgloo-dev and rebuild)\n";
#endif
#ifdef CHORUS_WITH_MPI
  s += std::string("MPI: ") + CHORUS_MPI_VERSION + " (mpirun-launched jobs are read from its environment)\n";
#else
  s += "MPI: no (mpirun launches still work when its environment is set)\n";
#endif
  s += "BLAS: OpenBLAS\n";
  s += "commit: " + git_commit() + "\n";
  return s;
}

// What init_process_group would see, when a launcher started this process.
void print_launch_env() {
  std::optional<dist::LaunchEnv> env;
  try {
    env = dist::read_launch_env();
  } catch (const Error& e) {
    std::printf("distributed: the launcher environment is invalid: %s\n", e.message().c_str());
    return;
  }
  if (!env) {
    std::printf("distributed: not started by a launcher (chorus launch, torchrun, mpirun, srun)\n");
    return;
  }
  const bool gpu = cuda_device_count() > 0 && dist::nccl_backend_available();
  std::printf("distributed: launcher %s, rank %d of %d (local rank %d of %d), master %s:%d%s, backend %s%s\n",
              env->launcher.c_str(), env->rank, env->world_size, env->local_rank, env->local_world_size,
              env->master_addr.c_str(), env->master_port, env->use_agent_store ? " (the launcher's store)" : "",
              gpu ? "nccl" : "gloo",
              gpu ? (" on cuda:" + std::to_string(env->local_rank)).c_str() : "");
}

int run_devices() {
  std::printf("cpu:0..cpu:%d  %d logical CPU devices (host memory; set CHORUS_CPU_DEVICES to change)\n",
              cpu_device_count() - 1, cpu_device_count());
  int n = cuda_device_count();
  if (n == 0) {
    std::printf("no CUDA GPU%s\n", has_backend(DeviceType::CUDA) ? "" : " (this build has no CUDA support)");
  } else {
#ifdef CHORUS_WITH_CUDA
    std::printf("%s", cuda::devices_report().c_str());
#endif
  }
  print_launch_env();
  return 0;
}

}  // namespace chorus::app
