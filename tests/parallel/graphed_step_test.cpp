// parallel::GraphedStep (Note [Graphed step]) and the capture bookkeeping of
// core/graph_capture.h. On the CPU: a graphed step is the eager step, and
// host-side effects are deferred during a capture. On a GPU (*_CUDA): 20
// replayed steps of a CNN with batch norm against 20 eager steps of a twin
// (same seed, same batches, the learning rate changing every step), SGD and
// AdamW, fp32 and bf16; what cannot be captured falls back with one line; a
// smaller batch runs eagerly and the graph stays; the graph's memory goes
// with it.
#include <gtest/gtest.h>

#include <chorus/autograd/autocast.h>
#include <chorus/chorus.h>
#include <chorus/core/graph_capture.h>
#include <chorus/ops/comm.h>
#include <chorus/optim/adamw.h>
#include <chorus/optim/sgd.h>
#include <chorus/parallel/data_parallel.h>
#include <chorus/parallel/graphed_step.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "testing/compare.h"
#include "testing/deterministic.h"
#include "testing/steps.h"

#ifdef CHORUS_WITH_CUDA
#include "chorus/cuda/blas/blas.h"
#endif

namespace chorus::parallel {
namespace {

namespace F = nn::functional;

// Convolutions without bias before batch norm (as in Wide ResNet): a bias
// there gets a gradient that is zero up to rounding, which AdamW would turn
// into full-size steps of noise.
std::shared_ptr<nn::Sequential> cnn(bool dropout = false) {
  manual_seed(97);
  auto s = std::make_shared<nn::Sequential>();
  s->push_back(std::make_shared<nn::Conv2d>(nn::Conv2dOptions{3, 8, 3, 1, 1, 1, 1, false}));
  s->push_back(std::make_shared<nn::BatchNorm2d>(8));
  s->push_back(std::make_shared<nn::ReLU>());
  s->push_back(std::make_shared<nn::Conv2d>(nn::Conv2dOptions{8, 8, 3, 1, 1, 1, 1, false}));
  s->push_back(std::make_shared<nn::BatchNorm2d>(8));
  s->push_back(std::make_shared<nn::ReLU>());
  s->push_back(std::make_shared<nn::MaxPool2d>(nn::Pool2dOptions{2}));
  s->push_back(std::make_shared<nn::Flatten>());
  if (dropout) s->push_back(std::make_shared<nn::Dropout>(0.25));
  s->push_back(std::make_shared<nn::Linear>(8 * 8 * 8, 10));
  return s;
}

struct StepRun {
  NamedTensors state;       // weights and batch-norm buffers after the steps
  std::vector<double> losses;
  int64_t replays = 0, eager_calls = 0, step_count = 0;
  std::string reason;
  std::vector<std::string> lines;  // what on_fallback was told
  std::vector<std::vector<Tensor>> grads;  // per step, the masters' .grad() (read_grads)
};

struct StepSetup {
  Device device = cpu_device(0);
  bool graphed = true;
  bool adamw = false;
  bool bf16 = false;
  bool dropout = false;
  bool read_loss_inside = false;  // loss.item() in the step: cannot be captured
  int steps = test::test_steps(20, 3);  // CHORUS_TEST_STEPS under a sanitizer
  int64_t small_batch_at = -1;     // this step gets a batch of 8 instead of 16
};

StepRun train(const StepSetup& s) {
  auto net = cnn(s.dropout);
  net->to(s.device);
  std::unique_ptr<optim::Optimizer> opt;
  if (s.adamw) opt = std::make_unique<optim::AdamW>(net->parameters(), optim::AdamWOptions{1e-3, 0.9, 0.999, 1e-8, 0.01});
  else opt = std::make_unique<optim::SGD>(net->parameters(), optim::SGDOptions{0.05, 0.9, 0.0, 5e-4, true});
  StepRun run;
  GraphedStepOptions o;
  o.enabled = s.graphed;
  o.on_fallback = [&](const std::string& line) { run.lines.push_back(line); };
  const bool read_loss = s.read_loss_inside;
  const std::optional<DType> cast = s.bf16 ? std::optional<DType>(kBFloat16) : std::nullopt;
  GraphedStep step(
      [&, read_loss, cast](const std::vector<Tensor>& in) {
        Tensor loss;
        {
          AutocastGuard guard(cast);
          loss = F::cross_entropy(net->forward(in[0]), in[1]);
        }
        if (read_loss && loss.item() > 1e9) loss = loss * 0.0;  // a data-dependent branch
        opt->zero_grad();
        loss.backward();
        opt->step();
        return std::vector<Tensor>{loss};
      },
      o);
  manual_seed(2024);
  for (int i = 0; i < s.steps; ++i) {
    const int64_t n = i == s.small_batch_at ? 8 : 16;
    Tensor x = randn({n, 3, 16, 16}).to(s.device);
    Tensor y = randint(0, 10, {n}, {kInt64}).to(s.device);
    opt->set_lr((s.adamw ? 1e-3 : 0.05) * (1.0 - 0.03 * i));  // changes between replays
    run.losses.push_back(step({x, y})[0].item());
  }
  run.state = net->state_dict();
  run.replays = step.replays();
  run.eager_calls = step.eager_calls();
  run.reason = step.fallback_reason();
  run.step_count = opt->step_count();
  return run;
}

void expect_same(const StepRun& a, const StepRun& b, double tol) {
  ASSERT_EQ(a.state.size(), b.state.size());
  for (size_t i = 0; i < a.state.size(); ++i) {
    const double err = test::rel_err(a.state[i].second, b.state[i].second);
    EXPECT_LE(err, tol) << a.state[i].first;
  }
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i)
    EXPECT_NEAR(a.losses[i], b.losses[i], tol * std::max(1.0, std::abs(b.losses[i]))) << "loss of step " << i;
}

// The same training graphed and eager (`s.graphed` is ignored).
std::pair<StepRun, StepRun> graphed_and_eager(StepSetup s) {
  s.graphed = true;
  StepRun graphed = train(s);
  s.graphed = false;
  return {std::move(graphed), train(s)};
}

// ---- CPU --------------------------------------------------------------------------

TEST(GraphedStep, OnTheCpuItIsTheEagerStep) {
  StepSetup s;
  const auto [graphed, eager] = graphed_and_eager(s);
  expect_same(graphed, eager, 0.0);
  EXPECT_EQ(graphed.replays, 0);
  EXPECT_EQ(graphed.eager_calls, s.steps);
  EXPECT_NE(graphed.reason.find("CUDA device"), std::string::npos) << graphed.reason;
  EXPECT_TRUE(graphed.lines.empty());  // not a failure: graphs do not apply
  EXPECT_EQ(graphed.step_count, s.steps);
}

TEST(GraphedStep, RejectsAnEmptyFunctionAndNegativeWarmup) {
  EXPECT_THROW(GraphedStep(GraphedStep::Fn()), ValueError);
  GraphedStepOptions o;
  o.warmup_steps = -1;
  EXPECT_THROW(GraphedStep([](const std::vector<Tensor>& in) { return in; }, o), ValueError);
}

TEST(GraphCapture, HostEffectsRunNowOrAtEachReplay) {
  int n = 0;
  EXPECT_FALSE(capture_in_progress());
  on_each_replay([&] { ++n; });
  EXPECT_EQ(n, 1);  // no capture: at once
  EXPECT_NO_THROW(check_not_capturing("anything"));
  {
    CaptureScope scope;
    EXPECT_TRUE(capture_in_progress());
    EXPECT_THROW(CaptureScope(), CaptureError);  // one at a time
    on_each_replay([&] { n += 10; });
    on_each_replay([&] { n += 100; });
    EXPECT_EQ(n, 1);  // deferred
    try {
      check_not_capturing("reading the loss");
      ADD_FAILURE() << "no CaptureError";
    } catch (const CaptureError& e) {
      EXPECT_NE(std::string(e.what()).find("reading the loss cannot be part of a CUDA graph"), std::string::npos)
          << e.what();
    }
    auto actions = scope.take_actions();
    ASSERT_EQ(actions.size(), 2u);
    for (int replay = 0; replay < 3; ++replay)
      for (auto& a : actions) a();
    EXPECT_EQ(n, 1 + 3 * 110);
  }
  EXPECT_FALSE(capture_in_progress());
}

// Checks before each replay (Note [NCCL in a CUDA graph]): run at once
// outside a capture, kept inside one; each capture has its own generation.
TEST(GraphCapture, ChecksRunNowOrBeforeEachReplayAndCapturesAreCounted) {
  int n = 0;
  before_each_replay([&] { ++n; });
  EXPECT_EQ(n, 1);
  const uint64_t before = capture_generation();
  {
    CaptureScope scope;
    EXPECT_EQ(capture_generation(), before + 1);
    before_each_replay([&] { n += 10; });
    before_each_replay([] { throw DistError("the group was aborted"); });
    on_each_replay([&] { n += 1000; });
    EXPECT_EQ(n, 1);
    auto checks = scope.take_checks();
    ASSERT_EQ(checks.size(), 2u);
    EXPECT_TRUE(scope.take_checks().empty());  // taken once
    EXPECT_EQ(scope.take_actions().size(), 1u);  // kept apart from the checks
    checks[0]();
    EXPECT_EQ(n, 11);
    EXPECT_THROW(checks[1](), DistError);
  }
  {
    CaptureScope scope;  // a later capture: a new generation, no checks left over
    EXPECT_EQ(capture_generation(), before + 2);
    EXPECT_TRUE(scope.take_checks().empty());
  }
  EXPECT_EQ(capture_generation(), before + 2);
}

// Note [Optimizer scalars on the device]: the optimizer's host bookkeeping is
// deferred in a capture, and the learning rate cannot change inside one.
TEST(GraphCapture, OptimizerCountsAtReplayAndRefusesANewLearningRateInside) {
  auto net = cnn();
  optim::SGD opt(net->parameters(), {0.05, 0.9, 0.0, 5e-4, true});
  Tensor loss = F::cross_entropy(net->forward(randn({4, 3, 16, 16})), randint(0, 10, {4}, {kInt64}));
  loss.backward();
  opt.step();  // creates the momentum buffers
  EXPECT_EQ(opt.step_count(), 1);
  CaptureScope scope;
  EXPECT_THROW(opt.set_lr(0.01), CaptureError);
  EXPECT_DOUBLE_EQ(opt.lr(), 0.05);
  opt.step();
  EXPECT_EQ(opt.step_count(), 1);  // deferred to the replays
  for (auto& a : scope.take_actions()) a();
  EXPECT_EQ(opt.step_count(), 2);
}

TEST(GraphCapture, FirstOptimizerStepCannotBeCaptured) {
  auto net = cnn();
  optim::SGD opt(net->parameters(), {0.05, 0.9, 0.0, 5e-4, true});
  Tensor loss = F::cross_entropy(net->forward(randn({4, 3, 16, 16})), randint(0, 10, {4}, {kInt64}));
  loss.backward();
  CaptureScope scope;
  try {
    opt.step();
    ADD_FAILURE() << "no CaptureError";
  } catch (const CaptureError& e) {
    EXPECT_NE(std::string(e.what()).find("first step"), std::string::npos) << e.what();
  }
  EXPECT_EQ(opt.step_count(), 0);
}

// ---- GPU --------------------------------------------------------------------------

#ifdef CHORUS_WITH_CUDA

// cuDNN's fastest weight-gradient engines sum with atomics, so two eager runs
// differ by about 1e-6 after 20 steps; the comparisons below use only
// deterministic engines, so that any difference is the graph's.
using Deterministic = test::DeterministicConvolutions;

TEST(GraphedStep, TwentyStepsMatchEagerFp32Sgd_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  Deterministic same_bits;
  StepSetup s;
  s.device = cuda_device(0);
  const auto [graphed, eager] = graphed_and_eager(s);
  EXPECT_TRUE(graphed.lines.empty()) << graphed.lines[0];
  EXPECT_EQ(graphed.replays, s.steps - 2);  // 2 warm-up steps
  EXPECT_EQ(graphed.step_count, s.steps);
  expect_same(graphed, eager, 1e-6);
}

TEST(GraphedStep, TwentyStepsMatchEagerFp32AdamW_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  Deterministic same_bits;
  StepSetup s;
  s.device = cuda_device(0);
  s.adamw = true;
  const auto [graphed, eager] = graphed_and_eager(s);
  EXPECT_TRUE(graphed.lines.empty()) << graphed.lines[0];
  EXPECT_EQ(graphed.replays, s.steps - 2);
  expect_same(graphed, eager, 1e-6);
}

// bf16 under autocast: the same kernels replayed, so the same rounding; the
// stated tolerance is 1e-3 (what bf16 reductions in another order could give).
TEST(GraphedStep, TwentyStepsMatchEagerBf16_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  Deterministic same_bits;
  StepSetup s;
  s.device = cuda_device(0);
  s.bf16 = true;
  const auto [graphed, eager] = graphed_and_eager(s);
  EXPECT_TRUE(graphed.lines.empty()) << graphed.lines[0];
  EXPECT_EQ(graphed.replays, s.steps - 2);
  expect_same(graphed, eager, 1e-3);
}

TEST(GraphedStep, AHostReadInTheStepFallsBackWithOneLine_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  Deterministic same_bits;
  StepSetup s;
  s.device = cuda_device(0);
  s.read_loss_inside = true;
  const auto [graphed, eager] = graphed_and_eager(s);
  ASSERT_EQ(graphed.lines.size(), 1u);
  EXPECT_NE(graphed.lines[0].find("cannot be captured"), std::string::npos) << graphed.lines[0];
  EXPECT_NE(graphed.lines[0].find("reading a CUDA tensor on the host"), std::string::npos) << graphed.lines[0];
  EXPECT_EQ(graphed.replays, 0);
  EXPECT_EQ(graphed.eager_calls, s.steps);
  EXPECT_EQ(graphed.step_count, s.steps);  // the failed capture counted nothing
  expect_same(graphed, eager, 1e-6);
}

TEST(GraphedStep, DropoutFallsBack_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  Deterministic same_bits;
  StepSetup s;
  s.device = cuda_device(0);
  s.dropout = true;
  const auto [graphed, eager] = graphed_and_eager(s);
  ASSERT_EQ(graphed.lines.size(), 1u);
  EXPECT_NE(graphed.lines[0].find("random numbers"), std::string::npos) << graphed.lines[0];
  EXPECT_EQ(graphed.replays, 0);
  s.graphed = false;
  const StepRun again = train(s);
  expect_same(again, eager, 1e-6);  // eager is repeatable
  expect_same(graphed, eager, 1e-6);
}

TEST(GraphedStep, ASmallerBatchRunsEagerlyAndTheGraphStays_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  Deterministic same_bits;
  StepSetup s;
  s.device = cuda_device(0);
  s.steps = std::max(s.steps, 5);  // 2 warm-up steps, the capture, a replay, the small batch
  s.small_batch_at = std::min(9, s.steps - 1);
  const auto [graphed, eager] = graphed_and_eager(s);
  ASSERT_EQ(graphed.lines.size(), 1u);
  EXPECT_NE(graphed.lines[0].find("[8,3,16,16]"), std::string::npos) << graphed.lines[0];
  EXPECT_EQ(graphed.replays, s.steps - 3);
  EXPECT_EQ(graphed.eager_calls, 3);
  expect_same(graphed, eager, 1e-6);
}

// No convolution (compute-sanitizer's racecheck cannot follow cuDNN's
// tensor-core kernels): an MLP, SGD, 12 graphed steps against 12 eager ones.
TEST(GraphedStep, MlpMatchesEager_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const Device g = cuda_device(0);
  auto run = [&](bool graphed) {
    manual_seed(5);
    auto net = std::make_shared<nn::Sequential>();
    net->push_back(std::make_shared<nn::Linear>(32, 64));
    net->push_back(std::make_shared<nn::ReLU>());
    net->push_back(std::make_shared<nn::Linear>(64, 10));
    net->to(g);
    optim::SGD opt(net->parameters(), {0.1, 0.9, 0.0, 1e-4, true});
    GraphedStepOptions o;
    o.enabled = graphed;
    GraphedStep step(
        [&](const std::vector<Tensor>& in) {
          Tensor loss = F::cross_entropy(net->forward(in[0]), in[1]);
          opt.zero_grad();
          loss.backward();
          opt.step();
          return std::vector<Tensor>{loss};
        },
        o);
    manual_seed(6);
    for (int i = 0; i < 12; ++i) {
      opt.set_lr(0.1 / (1 + i));
      (void)step({randn({24, 32}).to(g), randint(0, 10, {24}, {kInt64}).to(g)});
    }
    EXPECT_EQ(step.replays(), graphed ? 10 : 0);
    return net->state_dict();
  };
  const NamedTensors a = run(true), b = run(false);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_LE(test::rel_err(a[i].second, b[i].second), 1e-6) << a[i].first;
}

// DataParallel captured whole: 20 graphed steps against 20 eager ones, small
// buckets so that reductions overlap the backward. Over two GPUs one graph
// spans both (replica threads on the capture's streams of both devices, the
// inputs' chunk copied peer to peer, the gradient reduction over NCCL inside
// the capture); over one GPU the replica is the plain module (nothing to
// copy to replicas: the capture must not try).
// `replicated`: the graphed run's replicas step their own weights (Note
// [Replicated updates]: all-reduce, no broadcast); the eager run broadcasts.
// On one device there is nothing to replicate.
// `per_replica_loss`: the graphed run computes each replica's loss on its
// device and starts one backward from all of them (Note [Per-replica losses]);
// the eager run gathers the outputs and computes the loss on the first GPU.
// `read_grads`: after each step both runs read every master's .grad() (out of
// the graph, between replays): the whole sums each time (Note [Pending sums
// in a captured step] in autograd/grad_finisher.cpp).
void dp_graphed_matches_eager(const std::vector<Device>& devs, bool replicated = false, bool per_replica_loss = false,
                              bool read_grads = false, dist::GradSumMethod grad_sum = dist::GradSumMethod::Auto) {
  Deterministic same_bits;
  const int steps = test::test_steps(20, 3);  // CHORUS_TEST_STEPS under a sanitizer
  auto run = [&](bool graphed, StepRun* out) {
    auto net = cnn();
    net->to(devs[0]);
    parallel::DataParallelOptions dpo;
    dpo.bucket_bytes = 4096;
    dpo.grad_sum = grad_sum;
    auto dp = std::make_shared<DataParallel>(net, devs, dpo);
    optim::SGD opt(net->parameters(), {0.05, 0.9, 0.0, 5e-4, true});
    if (graphed && replicated) {
      ReplicatedUpdates u = dp->replicate_updates(opt.params());
      opt.add_replicas(u.copies, u.after_step);
    }
    GraphedStepOptions o;
    o.enabled = graphed;
    o.devices = devs;
    o.on_fallback = [&](const std::string& line) { out->lines.push_back(line); };
    GraphedStep step(
        [&](const std::vector<Tensor>& in) {
          if (graphed && per_replica_loss) {
            ReplicaLosses r = dp->forward_loss(in[0], in[1], [](const nn::Value& out, const nn::Value& t) {
              return F::cross_entropy(out.tensor(), t.tensor());
            });
            // Gathered beside the backward (Note [Losses gathered beside the
            // backward]), and again after the step on the current stream:
            // the same adds and copies, so the same bits.
            const ReplicaLosses::Gathered g = r.gather_beside();
            opt.zero_grad();
            r.backward();
            opt.step();
            g.join();
            NoGradGuard no_grad;
            return std::vector<Tensor>{g.loss, r.loss(), g.output.tensor(), r.output().tensor()};
          }
          Tensor loss = F::cross_entropy(dp->forward(in[0]), in[1]);
          opt.zero_grad();
          loss.backward();
          opt.step();
          return std::vector<Tensor>{loss};
        },
        o);
    manual_seed(77);
    for (int i = 0; i < steps; ++i) {
      opt.set_lr(0.05 * (1.0 - 0.03 * i));
      const std::vector<Tensor> o =
          step({randn({32, 3, 16, 16}).to(devs[0]), randint(0, 10, {32}, {kInt64}).to(devs[0])});
      out->losses.push_back(o[0].item());
      if (o.size() == 4) {  // the loss and output gathered beside the backward, and after the step
        EXPECT_EQ(o[0].item(), o[1].item()) << "step " << i;
        EXPECT_EQ(o[2].device(), devs[0]);
        EXPECT_EQ(test::rel_err(o[2], o[3]), 0.0) << "step " << i;
      }
      if (read_grads) {
        out->grads.emplace_back();
        for (const Tensor& p : net->parameters()) out->grads.back().push_back(p.grad().clone());
      }
    }
    out->state = net->state_dict();
    out->replays = step.replays();
    // With replicated updates every replica holds the master's weights.
    if (graphed && replicated)
      for (size_t r = 1; r < devs.size(); ++r) {
        const auto reps = dp->replica(r)->parameters(), masters = net->parameters();
        for (size_t i = 0; i < masters.size(); ++i)
          EXPECT_EQ(test::rel_err(reps[i], masters[i]), 0.0) << "replica " << r << ", parameter " << i;
      }
  };
  StepRun graphed, eager;
  run(true, &graphed);
  run(false, &eager);
  for (const std::string& line : graphed.lines) ADD_FAILURE() << "fell back: " << line;
  EXPECT_EQ(graphed.replays, steps - 2);
  // Per-replica losses: the chunks' means weighted by their shares instead of
  // one mean, equal up to rounding.
  expect_same(graphed, eager, per_replica_loss ? 1e-5 : 1e-6);
  ASSERT_EQ(graphed.grads.size(), eager.grads.size());
  for (size_t i = 0; i < eager.grads.size(); ++i)
    for (size_t k = 0; k < eager.grads[i].size(); ++k)
      EXPECT_LE(test::rel_err(graphed.grads[i][k], eager.grads[i][k]), per_replica_loss ? 1e-5 : 1e-6)
          << "step " << i << ", parameter " << k;
}

TEST(GraphedStep, DataParallelOverTwoGpusMatchesEager_MultiCUDA) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs 2 CUDA devices";
  dp_graphed_matches_eager({cuda_device(0), cuda_device(1)});
}

TEST(GraphedStep, DataParallelWithReplicatedUpdatesOverTwoGpusMatchesEager_MultiCUDA) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs 2 CUDA devices";
  dp_graphed_matches_eager({cuda_device(0), cuda_device(1)}, /*replicated=*/true);
}

TEST(GraphedStep, DataParallelWithPerReplicaLossesOverTwoGpusMatchesEager_MultiCUDA) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs 2 CUDA devices";
  dp_graphed_matches_eager({cuda_device(0), cuda_device(1)}, /*replicated=*/true, /*per_replica_loss=*/true);
}

// The same with the gradients summed by the copy engines (Note [Copy-engine
// all-reduce] in cuda/kernels/peer_all_reduce.h): memcpy nodes between the GPUs and
// the sum kernels inside the one graph.
TEST(GraphedStep, DataParallelWithCopyEngineAllReduceMatchesEager_MultiCUDA) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs 2 CUDA devices";
  dp_graphed_matches_eager({cuda_device(0), cuda_device(1)}, /*replicated=*/true, /*per_replica_loss=*/true,
                           /*read_grads=*/false, dist::GradSumMethod::CopyEngine);
}

// The gradients exchanged and summed by the optimizer's update (Note
// [Gradient sums in the update] in data_parallel/reducer.h): memcpy nodes between the
// GPUs, the sum in the update's kernel; a gradient read between replays is
// the whole sum after every replay, not only after the first.
TEST(GraphedStep, DataParallelWithSumsInUpdateMatchesEager_MultiCUDA) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs 2 CUDA devices";
  if (!ops::exchange_possible({cuda_device(0), cuda_device(1)})) GTEST_SKIP() << "no peer access";
  dp_graphed_matches_eager({cuda_device(0), cuda_device(1)}, /*replicated=*/true, /*per_replica_loss=*/true,
                           /*read_grads=*/true, dist::GradSumMethod::InUpdate);
}

TEST(GraphedStep, DataParallelOverOneGpuMatchesEager_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  dp_graphed_matches_eager({cuda_device(0)});
}

// Returned tensors are copies: a later replay does not overwrite them.
TEST(GraphedStep, OutputsSurviveLaterReplaysAndTheMemoryGoesWithTheGraph_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const Device g = cuda_device(0);
  auto net = cnn();
  net->to(g);
  optim::SGD opt(net->parameters(), {0.05, 0.9, 0.0, 5e-4, true});
  auto fn = [&](const std::vector<Tensor>& in) {
    Tensor out = net->forward(in[0]);
    Tensor loss = F::cross_entropy(out, in[1]);
    opt.zero_grad();
    loss.backward();
    opt.step();
    return std::vector<Tensor>{out, loss};
  };
  {
    GraphedStep step(fn);
    Tensor y = randint(0, 10, {16}, {kInt64}).to(g);
    std::vector<Tensor> first;
    for (int i = 0; i < 4; ++i) {
      std::vector<Tensor> out = step({randn({16, 3, 16, 16}).to(g), y});
      if (i == 2) first = out;  // the first replay's
    }
    EXPECT_EQ(step.replays(), 2);
    EXPECT_GT(backend(g).graph_pool_bytes(g), 0u);
    const std::vector<float> kept = first[0].to(cpu_device(0)).to_vector<float>();
    (void)step({randn({16, 3, 16, 16}).to(g), y});
    EXPECT_EQ(first[0].to(cpu_device(0)).to_vector<float>(), kept);
  }
  // The gradients were made in the graph's pool; once they go, so does it.
  EXPECT_GT(backend(g).graph_pool_bytes(g), 0u);
  opt.zero_grad();
  EXPECT_EQ(backend(g).graph_pool_bytes(g), 0u);
}

// Note [Graph pools]: a block freed inside the capture is carved for later
// requests of other sizes (the backward's gradients in the forward's freed
// activations), where exact size classes made the pool grow by their sum.
TEST(GraphedStep, ThePoolCarvesFreedBlocksForRequestsOfOtherSizes_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const Device g = cuda_device(0);
  constexpr int64_t kBig = int64_t{25} << 20, kSmall = int64_t{10} << 20;  // 100 MiB, 40 MiB of floats
  auto fn = [&](const std::vector<Tensor>& in) {
    Tensor s1;
    {
      Tensor t = in[0] * 2.0;  // 100 MiB, freed at once
      s1 = t.sum();
    }
    Tensor a = in[0].narrow(0, 0, kSmall) * 3.0;  // two 40 MiB blocks in its place
    Tensor b = in[0].narrow(0, kSmall, kSmall) + 1.0;
    return std::vector<Tensor>{s1 + a.sum() + b.sum()};
  };
  const size_t before = backend(g).graph_pool_bytes(g);
  {
    GraphedStep step(fn);
    Tensor x = randn({kBig}).to(g);
    std::vector<double> got;
    for (int i = 0; i < 4; ++i) got.push_back(step({x})[0].item());
    ASSERT_EQ(step.replays(), 2);
    EXPECT_NEAR(got[3], got[0], 1e-6 * std::abs(got[0]));  // replayed as run eagerly
    const size_t pool = backend(g).graph_pool_bytes(g) - before;
    EXPECT_GE(pool, static_cast<size_t>(kBig) * 4);
    EXPECT_LT(pool, static_cast<size_t>(kBig) * 4 + (size_t{8} << 20)) << "the 40 MiB blocks did not reuse the 100 MiB one";
  }
  EXPECT_EQ(backend(g).graph_pool_bytes(g), before);
}

#endif  // CHORUS_WITH_CUDA

}  // namespace
}  // namespace chorus::parallel
