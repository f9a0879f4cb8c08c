// dist::SyncBatchNorm in one process, against nn::BatchNorm2d on the global
// batch (its CPU kernel: two passes in double): alone (a group of one), and
// over the replicas of a DataParallel on logical CPU devices, where training
// must match one device on the whole batch step for step, running statistics
// included. Also convert_sync_batchnorm (names, tensors, options, modes),
// evaluation without communication, and a failing replica that must not leave
// the others waiting. The multi-process cases run in tests/distributed/sync_batch_norm.sh.
#include <gtest/gtest.h>

#include <chorus/chorus.h>
#include <chorus/data_parallel/sync_batch_norm.h>
#include <chorus/optim/sgd.h>
#include <chorus/parallel/data_parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "testing/devices.h"
#include "testing/compare.h"
#include "testing/expect_error.h"

namespace chorus::dist {
namespace {

namespace F = nn::functional;
using test::rel_err;

constexpr double kTol = 1e-5;

using test::cpus;

// Random, with a mean away from zero and unequal spreads per channel.
Tensor random_input(const Shape& shape, uint64_t seed) {
  manual_seed(seed);
  return randn(shape).mul(1.5).add(0.7);
}

void randomize_affine(nn::Module& bn, uint64_t seed) {
  manual_seed(seed);
  NoGradGuard ng;
  for (auto& [n, p] : bn.own_parameters()) p.copy_(randn(p.sizes()).mul(0.5).add(1.0));
}

// y, dx, dweight, dbias and the buffers of `bn` after one training forward
// and a backward of sum(y * r).
struct Result {
  Tensor y, dx, dw, db;
  nn::NamedTensors buffers;
};
Result run_once(nn::Module& bn, const Tensor& x_in, const Tensor& r) {
  Tensor x = x_in.clone().set_requires_grad(true);
  Tensor y = bn.forward(x);
  chorus::sum(chorus::mul(y, r)).backward();
  Result out{y.detach(), x.grad(), Tensor(), Tensor(), bn.named_buffers()};
  if (!bn.own_parameters().empty()) {
    out.dw = bn.own_parameters()[0].second.grad();
    out.db = bn.own_parameters()[1].second.grad();
  }
  return out;
}

void expect_same(const Result& got, const Result& ref) {
  EXPECT_LE(rel_err(got.y, ref.y), kTol);
  EXPECT_LE(rel_err(got.dx, ref.dx), kTol);
  if (ref.dw.defined()) {
    EXPECT_LE(rel_err(got.dw, ref.dw), kTol);
    EXPECT_LE(rel_err(got.db, ref.db), kTol);
  }
  ASSERT_EQ(got.buffers.size(), ref.buffers.size());
  for (size_t i = 0; i < ref.buffers.size(); ++i) {
    EXPECT_EQ(got.buffers[i].first, ref.buffers[i].first);
    EXPECT_LE(rel_err(got.buffers[i].second, ref.buffers[i].second), kTol) << ref.buffers[i].first;
  }
}

// ---- alone: the same numbers as BatchNorm2d -------------------------------------

TEST(SyncBatchNorm, AloneMatchesBatchNorm2d) {
  for (const Shape& shape : {Shape{6, 3, 4, 5}, Shape{9, 4}}) {
    for (bool affine : {true, false}) {
      SCOPED_TRACE(shape_str(shape) + (affine ? " affine" : " no affine"));
      const int64_t c = shape[1];
      nn::BatchNorm2d ref_bn(nn::BatchNorm2dOptions{c, 1e-5, 0.1, affine});
      SyncBatchNorm bn(SyncBatchNormOptions{c, 1e-5, 0.1, affine});
      randomize_affine(ref_bn, 5);
      randomize_affine(bn, 5);
      const Tensor x = random_input(shape, 1), r = random_input(shape, 2);
      expect_same(run_once(bn, x, r), run_once(ref_bn, x, r));
      // A second step moves the running statistics from non-default values.
      for (auto* m : std::initializer_list<nn::Module*>{&bn, &ref_bn}) m->zero_grad();
      const Tensor x2 = random_input(shape, 3);
      expect_same(run_once(bn, x2, r), run_once(ref_bn, x2, r));
      // Evaluation: the running statistics.
      bn.eval();
      ref_bn.eval();
      EXPECT_LE(rel_err(bn.forward(x), ref_bn.forward(x)), kTol);
    }
  }
}

TEST(SyncBatchNorm, FusedReluMatchesBatchNorm2d) {
  nn::BatchNorm2d ref_bn(4);
  SyncBatchNorm bn(4);
  const Tensor x = random_input({5, 4, 3, 3}, 7);
  EXPECT_LE(rel_err(bn.forward_relu(x), ref_bn.forward_relu(x)), kTol);
}

TEST(SyncBatchNorm, OneValuePerChannelIsAnError) {
  SyncBatchNorm bn(3);
  EXPECT_TRUE(test::throws_naming([&] { bn.forward(random_input({1, 3, 1, 1}, 1)); },
                                  {"SyncBatchNorm", "more than one value per channel", "[1, 3, 1, 1]"}));
}

// A group that counts its calls and sums over nobody else.
class CountingGroup final : public StatsGroup {
 public:
  Tensor sum(const Tensor& local, int) override {
    ++calls;
    return local;
  }
  std::atomic<int> calls{0};
};

TEST(SyncBatchNorm, OneCollectivePerTrainingForwardAndNoneInEvaluation) {
  SyncBatchNorm bn(3);
  auto group = std::make_shared<CountingGroup>();
  bn.set_stats_group(group, 0);
  const Tensor x = random_input({4, 3, 2, 2}, 1);
  bn.forward(x);
  EXPECT_EQ(group->calls, 1);
  bn.eval();
  bn.forward(x);
  EXPECT_EQ(group->calls, 1);
}

// ---- convert_sync_batchnorm ---------------------------------------------------------

TEST(SyncBatchNorm, ConvertKeepsNamesTensorsOptionsAndModes) {
  manual_seed(3);
  nn::ModulePtr model = std::make_shared<models::SmallCNN>(models::ModelSpec{{2, 8, 8}, 5});
  nn::ModulePtr reference = model->clone();
  // Non-default running statistics and a module in eval mode.
  {
    NoGradGuard ng;
    for (auto& [n, t] : model->named_buffers())
      if (t.dtype() == kFloat32) t.copy_(rand(t.sizes()).add(0.5));
  }
  model->modules()[3]->eval();  // features.1: a BatchNorm2d
  const nn::NamedTensors before = model->state_dict();
  const auto params_before = model->parameters();

  nn::ModulePtr converted = convert_sync_batchnorm(model);
  EXPECT_EQ(converted, model);  // changed in place
  const nn::NamedTensors after = converted->state_dict();
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(after[i].first, before[i].first);
    EXPECT_TRUE(after[i].second.is_same(before[i].second)) << before[i].first << " is not the same tensor";
  }
  const auto params_after = converted->parameters();
  ASSERT_EQ(params_after.size(), params_before.size());
  for (size_t i = 0; i < params_after.size(); ++i) EXPECT_TRUE(params_after[i].is_same(params_before[i]));
  int sync = 0;
  for (const nn::ModulePtr& m : converted->modules()) {
    EXPECT_EQ(m->type_name() == "BatchNorm2d", false) << "a BatchNorm2d is left";
    if (auto s = std::dynamic_pointer_cast<SyncBatchNorm>(m)) ++sync;
  }
  EXPECT_EQ(sync, 2);
  EXPECT_FALSE(converted->modules()[3]->is_training());
  EXPECT_TRUE(converted->modules()[7]->is_training());
  EXPECT_NE(converted->str().find("SyncBatchNorm(64"), std::string::npos) << converted->str();

  // Alone, the converted model computes what the original computes, in both modes.
  reference->load_state_dict(before);
  reference->modules()[3]->eval();
  const Tensor x = random_input({6, 2, 8, 8}, 11);
  EXPECT_LE(rel_err(converted->forward(x), reference->forward(x)), kTol);
  converted->eval();
  reference->eval();
  EXPECT_LE(rel_err(converted->forward(x), reference->forward(x)), kTol);

  // A root that is itself a BatchNorm2d comes back converted; a shared one
  // becomes one SyncBatchNorm in both places; options carry over.
  auto root = std::make_shared<nn::BatchNorm2d>(nn::BatchNorm2dOptions{5, 1e-3, 0.25, true});
  auto as_sync = std::dynamic_pointer_cast<SyncBatchNorm>(convert_sync_batchnorm(root));
  ASSERT_NE(as_sync, nullptr);
  EXPECT_EQ(as_sync->options_for_clone().eps, 1e-3);
  EXPECT_EQ(as_sync->options_for_clone().momentum, 0.25);
  EXPECT_TRUE(as_sync->own_parameters()[0].second.is_same(root->own_parameters()[0].second));
  auto shared = std::make_shared<nn::BatchNorm2d>(3);
  auto seq = std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{shared, shared});
  convert_sync_batchnorm(seq);
  EXPECT_EQ((*seq)[0], (*seq)[1]);
  EXPECT_NE(std::dynamic_pointer_cast<SyncBatchNorm>((*seq)[0]), nullptr);
  // nn:: spells the same thing.
  nn::ModulePtr again = nn::convert_sync_batchnorm(seq);
  EXPECT_EQ((*seq)[0], std::dynamic_pointer_cast<nn::SyncBatchNorm>((*seq)[0]));
  EXPECT_EQ(again, seq);
}

// ---- DataParallel on logical CPU devices: the global batch ----------------------

const models::ModelSpec kSpec{{2, 6, 6}, 5};
nn::ModulePtr make_bn_cnn() {
  return std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
      std::make_shared<nn::Conv2d>(nn::Conv2dOptions{2, 4, 3, 1, 1}), std::make_shared<nn::BatchNorm2d>(4),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::Conv2d>(nn::Conv2dOptions{4, 6, 3, 1, 1}),
      std::make_shared<nn::BatchNorm2d>(6), std::make_shared<nn::ReLU>(),
      std::make_shared<nn::MaxPool2d>(nn::Pool2dOptions{2}), std::make_shared<nn::Flatten>(),
      std::make_shared<nn::Linear>(6 * 3 * 3, 5)});
}

struct TrainRun {
  std::vector<double> losses;
  Tensor first_input_grad;
  nn::NamedTensors state;
};

TrainRun train(const std::function<nn::ModulePtr()>& build, const std::vector<int64_t>& batches) {
  manual_seed(1234);
  nn::ModulePtr model = build();
  optim::SGD opt(model->parameters(), optim::SGDOptions{.lr = 0.05, .momentum = 0.9});
  TrainRun run;
  for (size_t i = 0; i < batches.size(); ++i) {
    Tensor x = random_input({batches[i], 2, 6, 6}, 100 + i).to(model->device()).set_requires_grad(true);
    manual_seed(200 + i);
    Tensor y = randint(0, kSpec.classes, {batches[i]}).to(model->device());
    opt.zero_grad();
    Tensor loss = F::cross_entropy(model->forward(x), y);
    loss.backward();
    opt.step();
    run.losses.push_back(loss.item());
    if (i == 0) run.first_input_grad = x.grad();
  }
  for (const auto& [n, t] : model->state_dict()) run.state.emplace_back(n, t.to(cpu_device(0)).clone());
  return run;
}

// Prints the largest errors, for the record.
void expect_same_run(const TrainRun& got, const TrainRun& ref, const std::string& what) {
  ASSERT_EQ(got.losses.size(), ref.losses.size());
  double loss_err = 0, state_err = 0;
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    const double e = std::abs(got.losses[i] - ref.losses[i]) / std::abs(ref.losses[i]);
    EXPECT_LE(e, kTol) << "step " << i;
    loss_err = std::max(loss_err, e);
  }
  const double grad_err = rel_err(got.first_input_grad, ref.first_input_grad);
  EXPECT_LE(grad_err, kTol) << "the input's gradient";
  ASSERT_EQ(got.state.size(), ref.state.size());
  for (size_t i = 0; i < ref.state.size(); ++i) {
    EXPECT_EQ(got.state[i].first, ref.state[i].first);
    const double e = rel_err(got.state[i].second, ref.state[i].second);
    EXPECT_LE(e, kTol) << ref.state[i].first;
    state_err = std::max(state_err, e);
  }
  std::printf("%s: max relative error: losses %.2e, input gradient %.2e, weights and running stats %.2e\n",
              what.c_str(), loss_err, grad_err, state_err);
}

TEST(SyncBatchNorm, DataParallelReplicasTrainLikeOneDeviceOnTheGlobalBatch) {
  // Uneven chunks (7 over 3: 3, 2, 2), a batch smaller than the device count
  // (2 over 3: two replicas), and equal ones.
  const std::vector<int64_t> batches{7, 9, 2, 8};
  const TrainRun ref = train(make_bn_cnn, batches);
  for (int n : {1, 2, 3}) {
    SCOPED_TRACE(std::to_string(n) + " device(s)");
    TrainRun got = train(
        [n] { return std::make_shared<parallel::DataParallel>(convert_sync_batchnorm(make_bn_cnn()), cpus(n)); },
        batches);
    expect_same_run(got, ref, std::to_string(n) + " device(s)");
  }
  // Without SyncBatchNorm the replicas' statistics differ from the batch's:
  // the comparison above is not vacuous.
  TrainRun plain = train([] { return std::make_shared<parallel::DataParallel>(make_bn_cnn(), cpus(3)); }, batches);
  EXPECT_GT(rel_err(plain.first_input_grad, ref.first_input_grad), 1e-3);
}

TEST(SyncBatchNorm, DataParallelWiresOneGroupPerLayer) {
  auto dp = std::make_shared<parallel::DataParallel>(convert_sync_batchnorm(make_bn_cnn()), cpus(3));
  for (size_t r = 0; r < 3; ++r) {
    int layers = 0;
    for (const nn::ModulePtr& m : dp->replica(r)->modules())
      if (auto bn = std::dynamic_pointer_cast<SyncBatchNorm>(m)) {
        auto g = std::dynamic_pointer_cast<ReplicaStatsGroup>(bn->stats_group());
        ASSERT_NE(g, nullptr);
        EXPECT_EQ(g->members(), 3);
        EXPECT_EQ(bn->stats_member(), static_cast<int>(r));
        ++layers;
      }
    EXPECT_EQ(layers, 2);
  }
}

// A layer that fails on one device only (the index in g_fail_on), before the
// batch norm: the other replicas, waiting at the batch norm's sum, must fail
// too rather than wait.
std::atomic<int> g_fail_on{-1};
class FailOn : public nn::Module {
 public:
  explicit FailOn(nn::NoOptions = {}) : Module("FailOn") {}
  Tensor forward(const Tensor& x) override {
    CHORUS_CHECK(x.device().index != g_fail_on, "FailOn: planted failure on ", x.device().str());
    return x;
  }
  nn::NoOptions options_for_clone() const { return {}; }
  CHORUS_MODULE_CLONEABLE(FailOn)
};

TEST(SyncBatchNorm, AFailingReplicaFailsTheOthersInsteadOfHangingThem) {
  auto model = std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
      std::make_shared<FailOn>(), std::make_shared<SyncBatchNorm>(2)});
  parallel::DataParallel dp(model, cpus(3));
  const Tensor x = random_input({6, 2, 3, 3}, 1);
  g_fail_on = 2;
  EXPECT_TRUE(test::throws_naming<Error>([&] { dp.forward(x); }, {"planted failure on cpu:2"}));
  g_fail_on = -1;
  // The groups work again in the next forward.
  nn::BatchNorm2d ref(2);
  EXPECT_LE(rel_err(dp.forward(x), ref.forward(x)), kTol);
}

// ---- CUDA: the composed statistics in float32, the in-process NCCL sums ------------

TEST(SyncBatchNorm, AloneMatchesBatchNorm2d_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a CUDA device";
  nn::BatchNorm2d ref_bn(3);
  SyncBatchNorm bn(3);
  randomize_affine(ref_bn, 5);
  randomize_affine(bn, 5);
  bn.to(cuda_device(0));
  const Shape shape{6, 3, 4, 5};
  const Tensor x = random_input(shape, 1), r = random_input(shape, 2);
  Result got = run_once(bn, x.to(cuda_device(0)), r.to(cuda_device(0)));
  Result ref = run_once(ref_bn, x, r);
  expect_same(got, ref);
}

TEST(SyncBatchNorm, DataParallelReplicasTrainLikeOneDeviceOnTheGlobalBatch_MultiCUDA) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  const std::vector<int64_t> batches{7, 9, 2, 8};
  auto on = [](const Device& d) {
    nn::ModulePtr m = make_bn_cnn();
    m->to(d);
    return m;
  };
  // The reference: one GPU (the same convolution kernels as the replicas').
  const TrainRun ref = train([&] { return on(cuda_device(0)); }, batches);
  TrainRun got = train(
      [&] {
        return std::make_shared<parallel::DataParallel>(convert_sync_batchnorm(on(cuda_device(0))),
                                                        std::vector<Device>{cuda_device(0), cuda_device(1)});
      },
      batches);
  expect_same_run(got, ref, "2 GPUs");
}

}  // namespace
}  // namespace chorus::dist
