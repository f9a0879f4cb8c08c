#include "chorus/distributed/launch_env.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <string>
#include <vector>

#include "chorus/core/error.h"
#include "chorus/distributed/job_secret.h"

namespace chorus::dist {

namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

int env_int(const char* name, int lo, int hi) {
  const char* v = env(name);
  CHORUS_ASSERT(v != nullptr);
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v, &end, 10);
  CHORUS_CHECK(end && *end == '\0' && errno == 0, "environment variable ", name, "='", v, "' is not an integer");
  CHORUS_CHECK(x >= lo && x <= hi, "environment variable ", name, "=", x, " is out of range [", lo, ", ", hi, "]");
  return static_cast<int>(x);
}

}  // namespace

// "node[01-03,07],gpu5" -> "node01": the first host of a Slurm host list.
std::string first_slurm_host(const std::string& list) {
  std::string first;
  size_t i = 0;
  while (i < list.size() && list[i] != ',' && list[i] != '[') first += list[i++];
  if (i < list.size() && list[i] == '[') {
    ++i;
    std::string range;
    while (i < list.size() && list[i] != ',' && list[i] != '-' && list[i] != ']') range += list[i++];
    first += range;
  }
  return first;
}

// Note [Job ids] in launch_env.h.
std::string job_id_of_environment(const std::string& launcher) {
  auto set = [](const char* k) { return env(k) != nullptr; };
  if (set("CHORUS_RUN_ID")) return std::string("chorus:") + env("CHORUS_RUN_ID");
  if (launcher == "torchrun" && set("TORCHELASTIC_RUN_ID") && std::string(env("TORCHELASTIC_RUN_ID")) != "none")
    return std::string("torchrun:") + env("TORCHELASTIC_RUN_ID");
  if (launcher == "mpirun" && set("PMIX_NAMESPACE")) return std::string("pmix:") + env("PMIX_NAMESPACE");
  if (launcher == "mpirun" && set("OMPI_MCA_ess_base_jobid"))
    return std::string("ompi:") + env("OMPI_MCA_ess_base_jobid");
  if (launcher == "slurm" && set("SLURM_JOB_ID"))
    return std::string("slurm:") + env("SLURM_JOB_ID") + (set("SLURM_STEP_ID") ? std::string(".") + env("SLURM_STEP_ID") : "");
  return "";
}

std::optional<LaunchEnv> read_launch_env() {
  LaunchEnv e;
  if (env("RANK") && env("WORLD_SIZE")) {
    // torchrun and chorus launch set the same variables; the launcher says
    // which (TORCHELASTIC_RUN_ID is torchrun's).
    e.launcher = env("CHORUS_LAUNCHER") ? "chorus" : env("TORCHELASTIC_RUN_ID") ? "torchrun" : "env";
    e.world_size = env_int("WORLD_SIZE", 1, 1 << 20);
    e.rank = env_int("RANK", 0, e.world_size - 1);
    e.local_rank = env("LOCAL_RANK") ? env_int("LOCAL_RANK", 0, e.world_size - 1) : e.rank;
    e.local_world_size = env("LOCAL_WORLD_SIZE") ? env_int("LOCAL_WORLD_SIZE", 1, e.world_size) : e.world_size;
  } else if (env("OMPI_COMM_WORLD_RANK") && env("OMPI_COMM_WORLD_SIZE")) {
    e.launcher = "mpirun";
    e.world_size = env_int("OMPI_COMM_WORLD_SIZE", 1, 1 << 20);
    e.rank = env_int("OMPI_COMM_WORLD_RANK", 0, e.world_size - 1);
    e.local_rank = env("OMPI_COMM_WORLD_LOCAL_RANK") ? env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0, e.world_size - 1) : 0;
    e.local_world_size =
        env("OMPI_COMM_WORLD_LOCAL_SIZE") ? env_int("OMPI_COMM_WORLD_LOCAL_SIZE", 1, e.world_size) : 1;
    // mpirun names no master: on one machine it is this one; across machines
    // the user says which (MASTER_ADDR, below).
    if (e.local_world_size == e.world_size) e.master_addr = "127.0.0.1";
  } else if (env("SLURM_PROCID") && env("SLURM_NTASKS")) {
    e.launcher = "slurm";
    e.world_size = env_int("SLURM_NTASKS", 1, 1 << 20);
    e.rank = env_int("SLURM_PROCID", 0, e.world_size - 1);
    e.local_rank = env("SLURM_LOCALID") ? env_int("SLURM_LOCALID", 0, e.world_size - 1) : 0;
    if (env("SLURM_NTASKS_PER_NODE")) {
      // "4" or "4(x2)": the count before any parenthesis.
      e.local_world_size = std::max(1, std::atoi(env("SLURM_NTASKS_PER_NODE")));
    }
    if (env("SLURM_NODELIST")) e.master_addr = first_slurm_host(env("SLURM_NODELIST"));
    else if (env("SLURM_JOB_NODELIST")) e.master_addr = first_slurm_host(env("SLURM_JOB_NODELIST"));
  } else {
    return std::nullopt;
  }
  e.job_id = job_id_of_environment(e.launcher);
  e.job_secret = job_secret_from_environment();
  if (env("MASTER_ADDR")) e.master_addr = env("MASTER_ADDR");
  if (env("MASTER_PORT")) e.master_port = env_int("MASTER_PORT", 1, 65535);
  const char* agent = env("TORCHELASTIC_USE_AGENT_STORE");
  e.use_agent_store = agent && (std::string(agent) == "True" || std::string(agent) == "true" || std::string(agent) == "1");
  CHORUS_CHECK(!e.master_addr.empty(), "launched by ", e.launcher, " on ", e.world_size / std::max(1, e.local_world_size),
               "+ machines but MASTER_ADDR is not set: set MASTER_ADDR to the host of rank 0 (and MASTER_PORT to a "
               "free port) in every process's environment");
  return e;
}

}  // namespace chorus::dist
