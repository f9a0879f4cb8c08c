// What the two GPT step loops (train_gpt_loop.cpp: one model, its devices
// or ranks; train_gpt_mesh.cpp: over a device mesh) share between their
// steps: the log window (the steps since the last progress line), the end of
// each step (the --checkpoint-every checkpoint and the stop on a signal) and
// the end of a run a signal stopped.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "chorus/core/tensor.h"
#include "train.h"

namespace chorus::app {

// The steps since the last progress line: their losses stay on the device
// until the window closes (one host read per window).
struct LogWindow {
  explicit LogWindow(int64_t first_step) : first(first_step) {}
  // The window's per-step losses, on the device.
  std::vector<Tensor> losses;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  int64_t first;  // the window's first step (0-based)
  // Closed after step `next` - 1: the next window starts at step `next`.
  void restart(int64_t next);
};

// The end of step `step` (0-based; `last`: the run's last): the
// --checkpoint-every checkpoint through `save` (not after the last step:
// the run saves at its end), then, when `stop` (the ranks agreed on it in
// the log window), the stop on a signal (Note [Stopping on a signal]): the
// line saying so, `step` advanced to the steps done, and true (the loop
// ends).
bool end_gpt_step(const TrainConfig& tc, int64_t& step, bool last, bool stop, bool leader,
                  const std::function<void(int64_t)>& save);

// After the loop and its last checkpoint: when a signal stopped the run
// before `total_steps`, the line saying where the checkpoint is (`ckpt`; ""
// for none) and Interrupted.
void throw_if_stopped(int64_t step, int64_t total_steps, bool leader, const std::string& ckpt);

}  // namespace chorus::app
