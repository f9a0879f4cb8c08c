// LR schedules against their closed forms, composition, apply(), and checks.
#include "chorus/optim/lr_scheduler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "chorus/optim/sgd.h"
#include "optim/optim_reference.h"

namespace chorus::optim {
namespace {

using namespace testing;

TEST(LRSchedule, StepLRDecaysEveryStepSize) {
  StepLR s(0.1, 30, 0.1);
  for (int64_t step : {0, 1, 29, 30, 59, 60, 95}) {
    const double want = 0.1 * std::pow(0.1, std::floor(step / 30.0));
    EXPECT_NEAR(s.lr_at(step), want, 1e-15) << step;
  }
}

TEST(LRSchedule, CosineFollowsTheClosedFormThenHoldsEtaMin) {
  const double base = 0.2, eta_min = 0.002;
  const int64_t T = 50;
  CosineAnnealingLR s(base, T, eta_min);
  for (int64_t step = 0; step <= T; ++step) {
    const double want = eta_min + (base - eta_min) * (1 + std::cos(std::numbers::pi * step / T)) / 2;
    EXPECT_NEAR(s.lr_at(step), want, 1e-15) << step;
  }
  EXPECT_DOUBLE_EQ(s.lr_at(0), base);
  EXPECT_DOUBLE_EQ(s.lr_at(T), eta_min);
  EXPECT_DOUBLE_EQ(s.lr_at(T + 17), eta_min);
  EXPECT_NEAR(s.lr_at(T / 2), (base + eta_min) / 2, 1e-15);
}

TEST(LRSchedule, LinearWarmupRampsThenRunsTheWrappedSchedule) {
  auto cosine = std::make_shared<CosineAnnealingLR>(0.4, 100, 0.0);
  LinearWarmup s(10, cosine);
  for (int64_t step = 0; step < 10; ++step) EXPECT_NEAR(s.lr_at(step), 0.4 * (step + 1) / 10.0, 1e-15) << step;
  for (int64_t step = 10; step < 120; step += 7) EXPECT_DOUBLE_EQ(s.lr_at(step), cosine->lr_at(step - 10)) << step;

  LinearWarmup constant(4, 0.08);
  EXPECT_DOUBLE_EQ(constant.lr_at(0), 0.02);
  EXPECT_DOUBLE_EQ(constant.lr_at(3), 0.08);
  EXPECT_DOUBLE_EQ(constant.lr_at(1000), 0.08);
  LinearWarmup none(0, 0.3);
  EXPECT_DOUBLE_EQ(none.lr_at(0), 0.3);
  // Composes with any schedule, including step decay.
  LinearWarmup steps(5, std::make_shared<StepLR>(1.0, 10, 0.5));
  EXPECT_DOUBLE_EQ(steps.lr_at(2), 0.6);
  EXPECT_DOUBLE_EQ(steps.lr_at(5 + 25), 0.25);
}

TEST(LRSchedule, ApplySetsTheOptimizersRate) {
  Tensor p = param_of(random_vec(3, 1), {3});
  SGD opt({p}, {.lr = 123});
  CosineAnnealingLR s(0.1, 10);
  s.apply(opt, 5);
  EXPECT_DOUBLE_EQ(opt.lr(), s.lr_at(5));
}

TEST(LRSchedule, RejectsBadArguments) {
  expect_throw_with<ValueError>([] { StepLR(0.1, 0); }, "StepLR: step_size must be > 0, got 0");
  expect_throw_with<ValueError>([] { StepLR(-0.1, 3); }, "StepLR: learning rate must be >= 0, got -0.1");
  expect_throw_with<ValueError>([] { CosineAnnealingLR(0.1, 0); }, "CosineAnnealingLR: T_max must be > 0, got 0");
  expect_throw_with<ValueError>([] { CosineAnnealingLR(0.1, 10, -1); }, "CosineAnnealingLR: eta_min must be >= 0");
  expect_throw_with<ValueError>([] { LinearWarmup(-1, 0.1); }, "LinearWarmup: warmup_steps must be >= 0, got -1");
  expect_throw_with<ValueError>([] { LinearWarmup(3, LRSchedulePtr()); }, "LinearWarmup: the schedule after warmup is null");
  expect_throw_with<ValueError>([] { StepLR(0.1, 3).lr_at(-2); }, "StepLR: step must be >= 0, got -2");
}

}  // namespace
}  // namespace chorus::optim
