#include "chorus/distributed/rendezvous.h"

#include <cstdlib>
#include <string>
#include <thread>

#include "chorus/core/error.h"
#include "chorus/core/warn.h"
#include "chorus/distributed/job_secret.h"
#include "chorus/distributed/store_address.h"
#include "chorus/distributed/prefix_store.h"

namespace chorus::dist {

namespace {
// A restarted job (chorus launch --max-restarts, torchrun) checks in afresh
// under its own namespace of the same store.
std::string generation() {
  for (const char* v : {"CHORUS_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"})
    if (const char* s = std::getenv(v); s && *s) return s;
  return "0";
}
std::string str(const Bytes& b) { return std::string(b.begin(), b.end()); }
}  // namespace

Rendezvous rendezvous(const LaunchEnv& env, std::chrono::milliseconds timeout) {
  Rendezvous r;
  const bool host_here = env.rank == 0 && !env.use_agent_store;
  // Note [Store job secret] (distributed/store_auth.h): torchrun's own store (its
  // agent's) knows no secret; every other store of a job is Chorus's.
  const bool torchrun_store = env.use_agent_store && env.launcher == "torchrun";
  const std::string secret = torchrun_store ? "" : env.job_secret;
  if (env.rank == 0 && secret.empty())
    warn_once("store without secret",
              torchrun_store ? "the job's store is torchrun's, which has no authentication: any process that reaches "
                               "MASTER_ADDR:MASTER_PORT can change this job's keys (docs/distributed.md, \"The store\")"
                             : std::string("the job's store has no secret (") + kJobSecretVariable +
                                   " is not set): any process that reaches MASTER_ADDR:MASTER_PORT can change this "
                                   "job's keys; give every process the same " + kJobSecretVariable +
                                   ", or start the job with chorus launch");
  std::string host = env.master_addr;
  if (host_here) {
    const std::string listen = store_listen_address(env.master_addr, env.local_world_size < env.world_size);
    r.server = std::make_shared<TCPStoreServer>(env.master_port, listen, secret);
    host = store_connect_address(listen);
  }
  auto tcp = std::make_shared<TCPStore>(host, env.master_port, timeout, secret);
  r.store = std::make_shared<PrefixStore>("chorus/" + generation(), tcp);
  Store& s = *r.store;

  // Note [Job ids]: a process of another job given the same MASTER_PORT
  // stops here, before it touches this job's keys (it would otherwise count
  // as one of its ranks, or make one of them "join twice"). A process whose
  // id is unknown is not checked.
  if (!env.job_id.empty()) {
    const std::string owner = str(s.compare_set("job", {}, Bytes(env.job_id.begin(), env.job_id.end())));
    CHORUS_CHECK_T(DistError, owner == env.job_id, "rendezvous at ", endpoint(env.master_addr, env.master_port),
                   ": the store there is another job's (job id '", owner, "', this process's '", env.job_id,
                   "'): two jobs were given MASTER_PORT=", env.master_port,
                   "; give each job its own port (if these processes are one job, set CHORUS_RUN_ID to one value "
                   "for all of them)");
  }
  // Every rank must agree on the world size: the first to arrive sets it.
  const std::string w = std::to_string(env.world_size);
  const std::string agreed = str(s.compare_set("world_size", {}, Bytes(w.begin(), w.end())));
  CHORUS_CHECK_T(DistError, agreed == w, "rendezvous: rank ", env.rank, " was started with world size ", w,
                 " but another rank of this job with ", agreed, "; every process must get the same WORLD_SIZE");
  // A rank number taken twice (two processes with the same RANK).
  const int64_t joins = s.add("rank/" + std::to_string(env.rank), 1);
  CHORUS_CHECK_T(DistError, joins == 1, "rendezvous: rank ", env.rank,
                 " joined twice: two processes of this job were given RANK=", env.rank);
  s.add("joined", 1);
  // Everyone in, or name who is not.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    if (std::stoll(str(s.get("joined"))) >= env.world_size) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      std::string missing;
      int count = 0;
      for (int q = 0; q < env.world_size && count < 16; ++q)
        if (!s.check({"rank/" + std::to_string(q)})) missing += (count++ ? ", " : "") + std::to_string(q);
      CHORUS_THROW(DistError, "rendezvous at ", endpoint(env.master_addr, env.master_port), ": after ",
                   timeout.count() / 1000.0, " s rank(s) ", missing, " of ", env.world_size, " had not joined");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return r;
}

}  // namespace chorus::dist
