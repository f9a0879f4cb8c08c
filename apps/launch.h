// `chorus launch`: starts the local processes of a distributed job with the
// rendezvous environment, serves the job's store, passes their output
// through, forwards signals, and ends the job when a process fails.
#pragma once

#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace chorus::app {

struct LaunchConfig {
  std::string nproc_per_node = "1";  // N, or "gpu": one per visible GPU
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  int max_restarts = 0;
  std::string log_dir;
  double grace_s = 10;       // a failed job's other ranks get this long to end by themselves
  // --max-restarts waits this long before the first restart, twice as long
  // before each next one, at most kMaxRestartBackoff (0: no wait).
  double restart_backoff_s = 1;
  // After a forwarded SIGINT/SIGTERM/SIGHUP the workers get this long to
  // finish their step and write their stop checkpoint before SIGKILL.
  double stop_timeout_s = 60;
  // The job secret's file (Note [Store job secret] in distributed/store_auth.h);
  // empty: CHORUS_JOB_SECRET, or on one node a fresh random secret.
  std::string job_secret_file;
  std::vector<std::string> command;  // PROGRAM ARGS...
};

inline constexpr double kMaxRestartBackoff = 60;
inline constexpr double kMaxGracePeriod = 86400;  // a day: past that, a typo

void add_launch_options(CLI::App* cmd, LaunchConfig& c);
// Returns the launcher's exit code: 0 when every process succeeded.
int run_launch(const LaunchConfig& c);

}  // namespace chorus::app
