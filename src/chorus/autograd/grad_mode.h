// Gradient recording switch (thread-local), as torch.no_grad().
#pragma once

namespace chorus {

bool grad_enabled();
void set_grad_enabled(bool on);

// RAII: no graph is recorded while it lives (evaluation, optimizer updates).
class NoGradGuard {
 public:
  NoGradGuard();
  ~NoGradGuard();
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};

// True while a pipeline stage recomputes a forward for its backward
// (activation checkpointing): layers with running statistics (batch norm)
// must not count the same batch twice.
bool recomputing();

class RecomputeGuard {
 public:
  RecomputeGuard();
  ~RecomputeGuard();
  RecomputeGuard(const RecomputeGuard&) = delete;
  RecomputeGuard& operator=(const RecomputeGuard&) = delete;

 private:
  bool prev_;
};

}  // namespace chorus
