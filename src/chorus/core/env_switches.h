// The CHORUS_* environment switches, in one table.
//
// Note [Environment switches]: the library takes its choices from options
// (DataParallelOptions, DDPOptions, ...); the few process-wide settings an
// environment variable may still change -- the CPU's logical devices and
// threads, diagnostics, and the A/B switches that turn a faster path off to
// compare it with the one it replaced -- are named here and nowhere else:
// every read goes through env::get, which refuses a name not in the table,
// and tests/meta/env_switches.sh checks that no std::getenv("CHORUS_...")
// is left outside this file and that the README documents each one. The
// launch protocol's variables (RANK, MASTER_ADDR, CHORUS_RUN_ID, the job
// secret, ...) are the launcher's contract, not switches: distributed/
// launch_env.h reads those.
#pragma once

#include <vector>

namespace chorus::env {

struct Switch {
  const char* name;
  // setting: a choice a user makes; diagnostic: output or checks for
  // investigating; comparison: turns a path off to measure against the
  // one it replaced; internal: set by chorus for its own child processes.
  const char* kind;
  const char* what;
};

// Every switch, in the order the README lists them.
const std::vector<Switch>& switches();

// std::getenv(name) for a switch in the table: nullptr when unset. Throws
// chorus::Error for a name the table does not have (a programming error:
// add the switch to the table and to the README first).
const char* get(const char* name);

}  // namespace chorus::env
