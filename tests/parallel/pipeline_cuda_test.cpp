// parallel::Pipeline on GPUs (Note [Pipeline transfers]: copies on their own
// streams, ordered by events) against the plain model on one GPU: same seed,
// same batch, same optimizer, TF32 off, so the only differences are
// summation orders: 1e-4. Two GPUs where there are two; otherwise cuda:0 and
// cpu:0 (a pipeline may mix device kinds).
#ifdef CHORUS_WITH_CUDA

#include <gtest/gtest.h>

#include <chorus/autograd/autocast.h>
#include <chorus/chorus.h>
#include <chorus/optim/sgd.h>
#include <chorus/parallel/graphed_step.h>
#include <chorus/parallel/pipeline.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "chorus/cuda/blas/blas.h"
#include "testing/compare.h"
#include "testing/steps.h"

namespace chorus::parallel {
namespace {

namespace F = nn::functional;

class NoTf32 {
 public:
  NoTf32() : conv_(cuda::allow_tf32_conv()), matmul_(cuda::allow_tf32_matmul()) { cuda::set_allow_tf32(false); }
  ~NoTf32() {
    cuda::set_allow_tf32_conv(conv_);
    cuda::set_allow_tf32_matmul(matmul_);
  }

 private:
  bool conv_, matmul_;
};

std::shared_ptr<nn::Sequential> cnn() {
  manual_seed(4321);
  auto s = std::make_shared<nn::Sequential>();
  s->push_back(std::make_shared<nn::Conv2d>(nn::Conv2dOptions{3, 8, 3, 1, 1}));
  s->push_back(std::make_shared<nn::ReLU>());
  s->push_back(std::make_shared<nn::Conv2d>(nn::Conv2dOptions{8, 8, 3, 1, 1}));
  s->push_back(std::make_shared<nn::ReLU>());
  s->push_back(std::make_shared<nn::Conv2d>(nn::Conv2dOptions{8, 8, 3, 1, 1}));
  s->push_back(std::make_shared<nn::ReLU>());
  s->push_back(std::make_shared<nn::MaxPool2d>(nn::Pool2dOptions{2}));
  s->push_back(std::make_shared<nn::Flatten>());
  s->push_back(std::make_shared<nn::Linear>(8 * 8 * 8, 10));
  return s;
}

Tensor ce(const Tensor& out, const Tensor& t) { return F::cross_entropy(out, t); }

NamedTensors train(Schedule sch, bool pipeline, int steps) {
  const Device g0 = cuda_device(0);
  const std::vector<Device> devs{g0, cuda_device_count() >= 2 ? cuda_device(1) : cpu_device(0)};
  auto net = cnn();
  net->to(g0);
  std::shared_ptr<Pipeline> pipe;
  if (pipeline) {
    PipelineOptions o;
    o.micro_batches = 4;
    o.schedule = sch;
    o.virtual_stages = sch == Schedule::Interleaved ? 2 : 1;
    pipe = std::make_shared<Pipeline>(net, std::vector<int64_t>{}, devs, o);
  }
  optim::SGD opt(net->parameters(), {.lr = 0.05, .momentum = 0.9});
  manual_seed(77);
  Tensor x = randn({16, 3, 16, 16}).to(g0), y = randint(0, 10, {16}).to(g0);
  for (int i = 0; i < steps; ++i) {
    opt.zero_grad();
    if (pipe) {
      pipe->train_step(x, y, ce);
    } else {
      ce(net->forward(x), y).backward();
    }
    opt.step();
  }
  NamedTensors out;
  for (const auto& [n, t] : net->state_dict()) out.emplace_back(n, t.to(cpu_device(0)).clone());
  return out;
}

TEST(PipelineCuda, EveryScheduleTrainsLikeOneGpu_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a CUDA device";
  NoTf32 no_tf32;
  const NamedTensors ref = train(Schedule::GPipe, false, 5);
  for (Schedule sch : {Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved}) {
    const NamedTensors got = train(sch, true, 5);
    ASSERT_EQ(got.size(), ref.size());
    for (size_t i = 0; i < ref.size(); ++i)
      EXPECT_LE(test::rel_err(got[i].second, ref[i].second), 1e-4) << schedule_name(sch) << ": " << ref[i].first;
  }
}

TEST(PipelineCuda, Bf16StepIsFiniteAndMeasured_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a CUDA device";
  const std::vector<Device> devs{cuda_device(0), cuda_device_count() >= 2 ? cuda_device(1) : cpu_device(0)};
  auto net = cnn();
  PipelineOptions o;
  o.micro_batches = 4;
  o.measure = true;
  o.checkpoint = Checkpoint::ExceptLast;
  Pipeline pipe(net, {}, devs, o);
  AutocastGuard cast(devs[1].is_cuda() ? std::optional<DType>(kBFloat16) : std::nullopt);
  auto r = pipe.train_step(randn({16, 3, 16, 16}).to(devs[0]), randint(0, 10, {16}).to(devs[0]), ce);
  EXPECT_TRUE(std::isfinite(r.loss.item()));
  EXPECT_GT(pipe.last_stats().busy_ms[0], 0);
  EXPECT_LT(pipe.last_stats().bubble, 1);
}

// Note [Pipelines and CUDA graphs]: the whole pipelined step captured as one
// CUDA graph over both GPUs (each stage's tasks on its device's thread,
// transfers on their copy streams) against the same steps run eagerly:
// deterministic convolutions, TF32 off, so equal to 1e-6; each schedule, a
// learning rate that changes every step. The batches are drawn before the
// steps (the data cannot depend on the steps' own draws), and the process's
// random stream must end where the eager steps leave it: the pipeline's
// per-step generator reservation has to happen on every replay too.
struct GraphedRun {
  NamedTensors weights;
  std::vector<double> losses;
  int64_t replays = 0;
  std::vector<std::string> lines;
  RngState rng_after;
};

GraphedRun train_graphed(Schedule sch, bool graphed) {
  const std::vector<Device> devs{cuda_device(0), cuda_device(1)};
  manual_seed(5);
  auto net = cnn();
  net->to(devs[0]);
  PipelineOptions o;
  o.micro_batches = 4;
  o.schedule = sch;
  o.virtual_stages = sch == Schedule::Interleaved ? 2 : 1;
  auto pipe = std::make_shared<Pipeline>(net, std::vector<int64_t>{}, devs, o);
  optim::SGD opt(net->parameters(), {.lr = 0.05, .momentum = 0.9});
  GraphedRun run;
  GraphedStepOptions go;
  go.enabled = graphed;
  go.devices = devs;
  go.on_fallback = [&run](const std::string& line) { run.lines.push_back(line); };
  GraphedStep step(
      [&](const std::vector<Tensor>& in) {
        opt.zero_grad();
        Tensor loss = pipe->train_step(in[0], in[1], ce).loss;
        opt.step();
        return std::vector<Tensor>{loss};
      },
      go);
  manual_seed(77);
  std::vector<std::pair<Tensor, Tensor>> batches;
  const int steps = test::test_steps(12, 3);  // CHORUS_TEST_STEPS under a sanitizer
  for (int i = 0; i < steps; ++i) batches.emplace_back(randn({16, 3, 16, 16}).to(devs[0]), randint(0, 10, {16}).to(devs[0]));
  for (int i = 0; i < steps; ++i) {
    opt.set_lr(0.05 / (1.0 + 0.1 * i));
    run.losses.push_back(step({batches[static_cast<size_t>(i)].first, batches[static_cast<size_t>(i)].second})[0].item());
  }
  run.replays = step.replays();
  run.rng_after = default_generator().state();
  for (const auto& [n, t] : net->state_dict()) run.weights.emplace_back(n, t.to(cpu_device(0)).clone());
  return run;
}

TEST(PipelineCuda, GraphedStepsEqualEagerOnTwoGpus_MultiCUDA) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs 2 CUDA devices";
  NoTf32 no_tf32;
  const bool prev = cuda::deterministic();
  cuda::set_deterministic(true);
  for (Schedule sch : {Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved}) {
    const GraphedRun eager = train_graphed(sch, false), graphed = train_graphed(sch, true);
    EXPECT_TRUE(graphed.lines.empty()) << schedule_name(sch) << " fell back: " << graphed.lines.at(0);
    EXPECT_EQ(eager.replays, 0);
    EXPECT_EQ(graphed.replays, static_cast<int64_t>(eager.losses.size()) - 2) << schedule_name(sch);
    EXPECT_EQ(graphed.rng_after.seed, eager.rng_after.seed) << schedule_name(sch);
    EXPECT_EQ(graphed.rng_after.offset, eager.rng_after.offset)
        << schedule_name(sch) << ": the replays did not advance the random stream as eager steps do";
    for (size_t i = 0; i < eager.losses.size(); ++i)
      EXPECT_NEAR(graphed.losses[i], eager.losses[i], 1e-6 * std::abs(eager.losses[i]))
          << schedule_name(sch) << " step " << i;
    ASSERT_EQ(graphed.weights.size(), eager.weights.size());
    double worst = 0;
    for (size_t i = 0; i < eager.weights.size(); ++i) {
      const double e = test::rel_err(graphed.weights[i].second, eager.weights[i].second);
      if (e > 1e-6) ADD_FAILURE() << schedule_name(sch) << ": " << eager.weights[i].first << " differs by " << e;
      worst = std::max(worst, e);
    }
    std::printf("pipeline %s graphed vs eager: %lld replays, max relative weight error %.3g\n",
                schedule_name(sch).c_str(), static_cast<long long>(graphed.replays), worst);
  }
  cuda::set_deterministic(prev);
}

}  // namespace
}  // namespace chorus::parallel

#endif  // CHORUS_WITH_CUDA
