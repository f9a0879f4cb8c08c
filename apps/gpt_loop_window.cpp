#include "gpt_loop_window.h"

#include <cstdio>

#include "stop_signal.h"

namespace chorus::app {

void LogWindow::restart(int64_t next) {
  losses.clear();
  start = std::chrono::steady_clock::now();
  first = next;
}

bool end_gpt_step(const TrainConfig& tc, int64_t& step, bool last, bool stop, bool leader,
                  const std::function<void(int64_t)>& save) {
  if (tc.checkpoint_every > 0 && (step + 1) % tc.checkpoint_every == 0 && !last) save(step + 1);
  if (!stop) return false;
  ++step;
  if (leader) std::fprintf(stderr, "stopping after step %lld on a signal\n", (long long)step);
  return true;
}

void throw_if_stopped(int64_t step, int64_t total_steps, bool leader, const std::string& ckpt) {
  const int sig = StopSignal::pending();
  if (sig == 0 || step >= total_steps) return;
  if (leader)
    std::fprintf(stderr, "%s", ckpt.empty() ? "no --checkpoint-dir: nothing was saved\n"
                                            : ("checkpoint written: " + ckpt + "\n").c_str());
  throw Interrupted(sig);
}

}  // namespace chorus::app
