// Stopping `chorus train` cleanly on SIGINT, SIGTERM and SIGHUP.
//
// Note [Stopping on a signal]: the handler only records the signal and says
// on stderr that the run will stop (write(2) is async-signal-safe; nothing
// else is done there). The training loop polls StopSignal::pending() after
// every step: it finishes that step, writes a checkpoint when a checkpoint
// directory is set, says where, and the program exits with 128 + the
// signal (130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP), as a shell
// reports a process killed by it. A second signal while stopping (Ctrl-C
// twice) exits at once with the same code, writing nothing more. Worker
// threads may receive the signal; the flag is all the handler touches. A
// signal the program was started with ignored (nohup, a background job of a
// shell without job control) stays ignored.
#pragma once

#include <csignal>
#include <stdexcept>
#include <string>

namespace chorus::app {

class StopSignal {
 public:
  // Installs the handlers; the destructor restores the previous ones.
  StopSignal();
  ~StopSignal();
  StopSignal(const StopSignal&) = delete;
  StopSignal& operator=(const StopSignal&) = delete;

  // The first signal received since construction, or 0.
  static int pending();
  // "SIGINT", "SIGTERM", "SIGHUP".
  static const char* name(int signal);

 private:
  struct sigaction old_[3];
};

// Thrown by the training driver after it stopped for a signal (and wrote
// its checkpoint); main() turns it into exit code 128 + signal.
class Interrupted : public std::runtime_error {
 public:
  explicit Interrupted(int signal)
      : std::runtime_error(std::string("stopped by ") + StopSignal::name(signal)), signal_(signal) {}
  int signal() const { return signal_; }
  int exit_code() const { return 128 + signal_; }

 private:
  int signal_;
};

}  // namespace chorus::app
