#include "stop_signal.h"

#include <unistd.h>

#include <atomic>
#include <cstring>

namespace chorus::app {

namespace {

constexpr int kSignals[3] = {SIGINT, SIGTERM, SIGHUP};
std::atomic<int> g_pending{0};
static_assert(std::atomic<int>::is_always_lock_free, "the handler needs a lock-free flag");

void say(const char* text) { (void)!::write(STDERR_FILENO, text, std::strlen(text)); }

// Note [A second signal]: only a second SIGINT (Ctrl-C pressed again: a
// person who will not wait) exits at once. A repeated SIGTERM or SIGHUP is
// usually a machine saying the same thing twice -- `timeout` signals the
// command and then its whole process group, a launcher forwards a signal the
// process also got from its terminal -- and must not cost the checkpoint
// that the first one is about to write.
extern "C" void on_signal(int sig) {
  int expected = 0;
  if (!g_pending.compare_exchange_strong(expected, sig)) {
    if (sig != SIGINT) return;
    say("\nchorus: second signal: exiting now, without a checkpoint\n");
    ::_exit(128 + expected);
  }
  say("\nchorus: ");
  say(StopSignal::name(sig));
  say(sig == SIGINT ? " received: stopping after this step (press Ctrl-C again to exit at once)\n"
                    : " received: stopping after this step\n");
}

}  // namespace

StopSignal::StopSignal() {
  g_pending = 0;
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // blocking reads and waits carry on; the loop polls the flag
  for (int i = 0; i < 3; ++i) {
    sigaction(kSignals[i], nullptr, &old_[i]);
    // An ignored signal stays ignored: `nohup` ignores SIGHUP, and a shell
    // without job control ignores SIGINT in its background jobs.
    if (old_[i].sa_handler != SIG_IGN) sigaction(kSignals[i], &sa, nullptr);
  }
}

StopSignal::~StopSignal() {
  for (int i = 0; i < 3; ++i) sigaction(kSignals[i], &old_[i], nullptr);
}

int StopSignal::pending() { return g_pending.load(std::memory_order_relaxed); }

const char* StopSignal::name(int signal) {
  switch (signal) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    case SIGHUP: return "SIGHUP";
    default: return "a signal";
  }
}

}  // namespace chorus::app
