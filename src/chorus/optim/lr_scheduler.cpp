#include "chorus/optim/lr_scheduler.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "chorus/core/error.h"
#include "chorus/optim/optimizer.h"

namespace chorus::optim {

namespace {
void check_step(const char* name, int64_t step) {
  CHORUS_CHECK(step >= 0, name, ": step must be >= 0, got ", step);
}
}  // namespace

void LRSchedule::apply(Optimizer& optimizer, int64_t step) const { optimizer.set_lr(lr_at(step)); }

ConstantLR::ConstantLR(double lr) : lr_(lr) {
  detail::check_hyper(lr >= 0, "ConstantLR", "learning rate", ">= 0", lr);
}

double ConstantLR::lr_at(int64_t step) const {
  check_step("ConstantLR", step);
  return lr_;
}

StepLR::StepLR(double base_lr, int64_t step_size, double gamma)
    : base_lr_(base_lr), step_size_(step_size), gamma_(gamma) {
  detail::check_hyper(base_lr >= 0, "StepLR", "learning rate", ">= 0", base_lr);
  detail::check_hyper(step_size > 0, "StepLR", "step_size", "> 0", static_cast<double>(step_size));
  detail::check_hyper(gamma >= 0, "StepLR", "gamma", ">= 0", gamma);
}

double StepLR::lr_at(int64_t step) const {
  check_step("StepLR", step);
  return base_lr_ * std::pow(gamma_, static_cast<double>(step / step_size_));
}

CosineAnnealingLR::CosineAnnealingLR(double base_lr, int64_t T_max, double eta_min)
    : base_lr_(base_lr), t_max_(T_max), eta_min_(eta_min) {
  detail::check_hyper(base_lr >= 0, "CosineAnnealingLR", "learning rate", ">= 0", base_lr);
  detail::check_hyper(T_max > 0, "CosineAnnealingLR", "T_max", "> 0", static_cast<double>(T_max));
  detail::check_hyper(eta_min >= 0, "CosineAnnealingLR", "eta_min", ">= 0", eta_min);
}

double CosineAnnealingLR::lr_at(int64_t step) const {
  check_step("CosineAnnealingLR", step);
  const double t = static_cast<double>(std::min(step, t_max_));
  return eta_min_ + (base_lr_ - eta_min_) * (1 + std::cos(std::numbers::pi * t / t_max_)) / 2;
}

LinearWarmup::LinearWarmup(int64_t warmup_steps, LRSchedulePtr after)
    : warmup_steps_(warmup_steps), after_(std::move(after)) {
  detail::check_hyper(warmup_steps >= 0, "LinearWarmup", "warmup_steps", ">= 0",
                      static_cast<double>(warmup_steps));
  CHORUS_CHECK(after_ != nullptr, "LinearWarmup: the schedule after warmup is null");
}

LinearWarmup::LinearWarmup(int64_t warmup_steps, double lr)
    : LinearWarmup(warmup_steps, std::make_shared<ConstantLR>(lr)) {}

double LinearWarmup::lr_at(int64_t step) const {
  check_step("LinearWarmup", step);
  if (step >= warmup_steps_) return after_->lr_at(step - warmup_steps_);
  return after_->lr_at(0) * static_cast<double>(step + 1) / static_cast<double>(warmup_steps_);
}

}  // namespace chorus::optim
