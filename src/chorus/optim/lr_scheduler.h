// Learning-rate schedules as pure functions of the global step.
//
// Design note: a schedule here is `lr_at(step)`, not PyTorch's stateful
// scheduler.step(). A pure function needs no state in checkpoints (resuming at
// step N just asks for lr_at(N)), cannot drift when a step is skipped, and
// composes by wrapping: LinearWarmup(500, CosineAnnealingLR(...)) is a value.
// `step` counts optimizer steps from 0; apply() sets the optimizer's lr.
//
// Closed forms (b = base_lr):
//   ConstantLR          b
//   StepLR              b * gamma^floor(step / step_size)                 (PyTorch's StepLR)
//   CosineAnnealingLR   eta_min + (b - eta_min) * (1 + cos(pi * t / T_max)) / 2,
//                       t = min(step, T_max)
//   LinearWarmup(W, s)  s.lr_at(0) * (step + 1) / W    for step < W
//                       s.lr_at(step - W)              afterwards
// Decisions: cosine holds eta_min after T_max instead of PyTorch's rising
// second half-period, which a run longer than T_max never wants. Warmup's
// first step already trains (lr/W, not 0), reaches the full rate at step W-1,
// and starts the wrapped schedule at its own step 0 afterwards, as
// "warmup then cosine over the remaining steps" recipes expect.
#pragma once

#include <cstdint>
#include <memory>

namespace chorus::optim {

class Optimizer;

class LRSchedule {
 public:
  virtual ~LRSchedule() = default;
  // The learning rate for global step `step` (>= 0).
  virtual double lr_at(int64_t step) const = 0;
  // optimizer.set_lr(lr_at(step)): call before each optimizer.step().
  void apply(Optimizer& optimizer, int64_t step) const;
};

using LRSchedulePtr = std::shared_ptr<const LRSchedule>;

class ConstantLR : public LRSchedule {
 public:
  explicit ConstantLR(double lr);
  double lr_at(int64_t step) const override;

 private:
  double lr_;
};

class StepLR : public LRSchedule {
 public:
  // Multiplies the rate by gamma every step_size steps; step_size > 0, gamma >= 0.
  StepLR(double base_lr, int64_t step_size, double gamma = 0.1);
  double lr_at(int64_t step) const override;

 private:
  double base_lr_;
  int64_t step_size_;
  double gamma_;
};

class CosineAnnealingLR : public LRSchedule {
 public:
  // From base_lr at step 0 to eta_min at step T_max (> 0), then eta_min.
  CosineAnnealingLR(double base_lr, int64_t T_max, double eta_min = 0);
  double lr_at(int64_t step) const override;

 private:
  double base_lr_;
  int64_t t_max_;
  double eta_min_;
};

class LinearWarmup : public LRSchedule {
 public:
  // Ramps linearly to `after`'s first rate over warmup_steps (>= 0; 0 means no
  // warmup), then runs `after` from its step 0.
  LinearWarmup(int64_t warmup_steps, LRSchedulePtr after);
  // Warmup to a constant rate.
  LinearWarmup(int64_t warmup_steps, double lr);
  double lr_at(int64_t step) const override;

 private:
  int64_t warmup_steps_;
  LRSchedulePtr after_;
};

}  // namespace chorus::optim
