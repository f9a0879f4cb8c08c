// LaunchEnv: what a process learns from the launcher that started it.
// read_launch_env() recognises, in this order:
//  - torchrun / chorus launch: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
//    MASTER_ADDR, MASTER_PORT (+ TORCHELASTIC_USE_AGENT_STORE, GROUP_RANK);
//  - OpenMPI: OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE;
//  - Slurm: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODELIST (the
//    first host of the list is the master), SLURM_NTASKS_PER_NODE.
// MASTER_ADDR / MASTER_PORT, where set, override what a launcher implies;
// CHORUS_JOB_SECRET, where set, is the job's secret (Note [Store job secret]).
#pragma once

#include <optional>
#include <string>

namespace chorus::dist {

struct LaunchEnv {
  std::string launcher;       // "torchrun", "chorus", "mpirun", "slurm", "env" (RANK etc. set by hand)
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr;    // host name or address of rank 0's store
  int master_port = 29500;
  bool use_agent_store = false;  // torchrun serves the store itself
  // Note [Job ids]: what tells this job from another given the same
  // MASTER_PORT: CHORUS_RUN_ID where set (chorus launch sets one on a single
  // node; set it yourself elsewhere), else the id of the launcher that
  // started this process, and only that one: torchrun's TORCHELASTIC_RUN_ID
  // (not its default "none"), mpirun's PMIX_NAMESPACE or
  // OMPI_MCA_ess_base_jobid, Slurm's SLURM_JOB_ID.SLURM_STEP_ID. (mpirun
  // inside a Slurm job starts ranks in different Slurm steps: a variable of
  // another launcher could differ between ranks of one job.) Empty: unknown,
  // and not checked.
  std::string job_id;
  // CHORUS_JOB_SECRET (distributed/job_secret.h); empty when unset. Never printed.
  std::string job_secret;
};

// The environment of the current process; nullopt when no launcher set one.
// Throws ValueError for malformed or inconsistent variables (a rank out of
// range, a non-numeric size), naming the variable.
std::optional<LaunchEnv> read_launch_env();

// The job id the environment gives a process started by `launcher` (as in
// LaunchEnv::launcher; Note [Job ids]); empty when none.
std::string job_id_of_environment(const std::string& launcher);

// The first host of a Slurm host list ("node[01-03,07],gpu5" -> "node01").
std::string first_slurm_host(const std::string& list);

}  // namespace chorus::dist
