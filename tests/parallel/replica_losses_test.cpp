// DataParallel's per-replica losses (Note [Per-replica losses] in
// parallel/data_parallel.h) on logical CPU devices: forward_loss + one
// backward from every replica's loss trains exactly like the gathered output
// with the loss on the first device (losses, weights, batch-norm buffers), with
// broadcast and replicated updates, over 2 and 3 devices and batches that leave
// chunks uneven or replicas out; the batch's loss and outputs, also gathered
// beside the backward (on two GPUs: the same bits); a summed loss; bad
// arguments.
#include <gtest/gtest.h>

#include <chorus/chorus.h>
#include <chorus/optim/sgd.h>
#include <chorus/parallel/data_parallel.h>

#include <memory>
#include <string>
#include <vector>

#include "testing/compare.h"
#include "testing/deterministic.h"
#include "testing/devices.h"
#include "testing/nets.h"
#include "testing/expect_error.h"

namespace chorus::parallel {
namespace replica_losses_test {  // names of its own in the unity build
namespace {

namespace F = nn::functional;
using test::cpus;
using test::rel_err;

constexpr double kTol = 1e-5;

std::shared_ptr<nn::Sequential> make_net() { return test::conv_bn_net(41); }

Tensor chunk_loss(const nn::Value& out, const nn::Value& t) { return F::cross_entropy(out.tensor(), t.tensor()); }

struct TrainRun {
  std::vector<double> losses;
  std::vector<Tensor> outputs;   // each step's output on the first device
  nn::NamedTensors state;
};

// How a run takes the batch's loss: the gathered output's, loss() after the
// backward, or gather_beside() before it (Note [Losses gathered beside the
// backward]), joined after the step.
enum class LossMode { Gathered, PerReplica, Beside };

TrainRun train(LossMode mode, bool replicated, const std::vector<Device>& devices, const std::vector<int64_t>& batches) {
  auto net = make_net();
  net->to(devices[0]);
  auto dp = std::make_shared<DataParallel>(net, devices);
  optim::SGD opt(dp->parameters(), {.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3, .nesterov = true});
  if (replicated) {
    ReplicatedUpdates u = dp->replicate_updates(opt.params());
    opt.add_replicas(u.copies, u.after_step);
  }
  manual_seed(5);
  Tensor x = randn({12, 2, 8, 8}).to(devices[0]), y = randint(0, 5, {12}).to(devices[0]);
  TrainRun run;
  for (int64_t b : batches) {
    Tensor xb = x.narrow(0, 0, b), yb = y.narrow(0, 0, b);
    opt.zero_grad();
    if (mode == LossMode::Beside) {
      ReplicaLosses r = dp->forward_loss(xb, yb, chunk_loss);
      const ReplicaLosses::Gathered g = r.gather_beside();
      r.backward();
      opt.step();  // the gathered values are the forward's, read after the step
      g.join();
      EXPECT_FALSE(g.loss.requires_grad());
      EXPECT_EQ(g.output.tensor().device(), devices[0]);
      run.losses.push_back(g.loss.item());
      run.outputs.push_back(g.output.tensor().clone());
      continue;
    }
    if (mode == LossMode::PerReplica) {
      ReplicaLosses r = dp->forward_loss(xb, yb, chunk_loss);
      r.backward();
      run.losses.push_back(r.loss().item());
      run.outputs.push_back(r.output().tensor().detach().clone());
      EXPECT_EQ(r.output().tensor().device(), devices[0]);
    } else {
      Tensor out = dp->forward(xb);
      Tensor loss = F::cross_entropy(out, yb);
      loss.backward();
      run.losses.push_back(loss.item());
      run.outputs.push_back(out.detach().clone());
    }
    opt.step();
  }
  for (const auto& [n, t] : net->state_dict()) run.state.emplace_back(n, t.clone());
  return run;
}

void expect_same_run(const TrainRun& got, const TrainRun& ref, double tol) {
  ASSERT_EQ(got.losses.size(), ref.losses.size());
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], ref.losses[i], tol * std::abs(ref.losses[i])) << "step " << i;
    EXPECT_LE(rel_err(got.outputs[i], ref.outputs[i]), tol) << "step " << i;
  }
  ASSERT_EQ(got.state.size(), ref.state.size());
  for (size_t i = 0; i < ref.state.size(); ++i)
    EXPECT_LE(rel_err(got.state[i].second, ref.state[i].second), tol) << ref.state[i].first;
}

TEST(ReplicaLosses, TrainLikeTheGatheredLoss) {
  // 7 over 3 devices: chunks of 3, 2, 2 (unequal weights); 1 and 2: replicas left out.
  const std::vector<int64_t> batches{12, 7, 1, 12, 2, 12, 5};
  for (bool replicated : {false, true}) {
    for (int devices : {2, 3}) {
      SCOPED_TRACE(std::string(replicated ? "replicated" : "broadcast") + ", " + std::to_string(devices) + " devices");
      const TrainRun ref = train(LossMode::Gathered, replicated, cpus(devices), batches);
      for (LossMode mode : {LossMode::PerReplica, LossMode::Beside}) {
        const TrainRun got = train(mode, replicated, cpus(devices), batches);
        expect_same_run(got, ref, kTol);
      }
      EXPECT_LT(ref.losses.back(), ref.losses.front());
    }
  }
}

#ifdef CHORUS_WITH_CUDA
// On two GPUs the gather goes on a stream of its own beside the backward:
// the same losses and outputs, bit for bit, as loss() and output() after the
// backward, and the same training (eager; the graphed step:
// GraphedStep.DataParallelWithPerReplicaLosses*).
TEST(ReplicaLosses, GatheredBesideTheBackwardOnTwoGpus_MultiCUDA) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs 2 CUDA devices";
  const std::vector<Device> gpus{cuda_device(0), cuda_device(1)};
  const std::vector<int64_t> batches{12, 7, 1, 12, 12, 12, 5};
  for (bool replicated : {false, true}) {
    SCOPED_TRACE(replicated ? "replicated" : "broadcast");
    test::DeterministicConvolutions same_bits;
    const TrainRun ref = train(LossMode::PerReplica, replicated, gpus, batches);
    const TrainRun got = train(LossMode::Beside, replicated, gpus, batches);
    expect_same_run(got, ref, 0.0);
    EXPECT_LT(ref.losses.back(), ref.losses.front());
  }
}
#endif  // CHORUS_WITH_CUDA

// The losses stay on their replicas' devices, weighted by their shares; with
// LossReduction::Sum they are added as they are.
TEST(ReplicaLosses, EachLossIsItsChunksOnItsDevice) {
  auto net = make_net();
  auto dp = std::make_shared<DataParallel>(net, cpus(3));
  manual_seed(8);
  Tensor x = randn({7, 2, 8, 8}), y = randint(0, 5, {7});
  ReplicaLosses r = dp->forward_loss(x, y, chunk_loss);
  ASSERT_EQ(r.losses.size(), 3u);
  const int64_t starts[] = {0, 3, 5}, lens[] = {3, 2, 2};
  Tensor full_out = dp->forward(x).detach();
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(r.losses[i].device(), cpu_device(i));
    const double chunk = F::cross_entropy(full_out.narrow(0, starts[i], lens[i]), y.narrow(0, starts[i], lens[i])).item();
    EXPECT_NEAR(r.losses[i].item(), chunk * lens[i] / 7.0, 1e-5 * std::abs(chunk));
  }
  EXPECT_NEAR(r.loss().item(), F::cross_entropy(full_out, y).item(), 1e-5);

  // A summed loss: the squares of the outputs, over the whole batch.
  auto squares = [](const nn::Value& out, const nn::Value&) { return mul(out.tensor(), out.tensor()).sum(); };
  ReplicaLosses s = dp->forward_loss(x, y, squares, LossReduction::Sum);
  EXPECT_NEAR(s.loss().item(), mul(full_out, full_out).sum().item(), 1e-4 * mul(full_out, full_out).sum().item());
  s.backward();
  const Tensor g_sum = net->parameters()[0].grad().clone();
  for (Tensor p : net->parameters()) p.zero_grad();
  ReplicaLosses again = dp->forward_loss(x, y, squares, LossReduction::Sum);
  again.loss().backward();  // through the gathered sum: slower, the same gradients
  EXPECT_LE(rel_err(net->parameters()[0].grad(), g_sum), kTol);
}

// x [B, 4] -> [fa(x), {"m": tanh(fb(x))}]: a nested output (nn::Value).
class NestedOut : public nn::Module {
 public:
  explicit NestedOut(nn::NoOptions = {}) : Module("NestedOut") {
    fa_ = register_module("fa", std::make_shared<nn::Linear>(4, 3));
    fb_ = register_module("fb", std::make_shared<nn::Linear>(4, 2));
  }
  nn::Value forward_value(const nn::Value& x) override {
    return nn::Value{fa_->forward(x.tensor()), nn::Value(nn::Value::Map{{"m", fb_->forward(x.tensor()).tanh()}})};
  }
  nn::NoOptions options_for_clone() const { return {}; }
  CHORUS_MODULE_CLONEABLE(NestedOut)
 private:
  std::shared_ptr<nn::Linear> fa_, fb_;
};

// gather_beside on a nested output: the same structure as output(), every
// tensor detached, with the same values; the loss too.
TEST(ReplicaLosses, GatheredBesideKeepsANestedOutputsStructure) {
  manual_seed(9);
  auto dp = std::make_shared<DataParallel>(std::make_shared<NestedOut>(), cpus(3));
  Tensor x = randn({7, 4}), y = randn({7, 3});
  auto mse = [](const nn::Value& out, const nn::Value& t) {
    return (out[0].tensor() - t.tensor()).pow(2.0).mean() + out[1]["m"].tensor().sum();
  };
  ReplicaLosses r = dp->forward_loss(x, y, mse);
  const ReplicaLosses::Gathered g = r.gather_beside();
  r.backward();
  g.join();
  const nn::Value want = r.output();
  ASSERT_TRUE(g.output.is_list());
  ASSERT_EQ(g.output.list().size(), 2u);
  ASSERT_TRUE(g.output[1].is_map());
  int tensors = 0;
  nn::for_each_tensor(g.output, [&](const Tensor& t) {
    EXPECT_FALSE(t.requires_grad());
    EXPECT_EQ(t.device(), cpu_device(0));
    ++tensors;
  });
  EXPECT_EQ(tensors, 2);
  EXPECT_EQ(g.output[0].tensor().sizes(), (Shape{7, 3}));
  EXPECT_EQ(rel_err(g.output[0].tensor(), want[0].tensor()), 0.0);
  EXPECT_EQ(rel_err(g.output[1]["m"].tensor(), want[1]["m"].tensor()), 0.0);
  EXPECT_EQ(g.loss.item(), r.loss().item());
  EXPECT_FALSE(g.loss.requires_grad());
}

TEST(ReplicaLosses, BadArgumentsAreNamed) {
  auto dp = std::make_shared<DataParallel>(make_net(), cpus(2));
  manual_seed(9);
  Tensor x = randn({6, 2, 8, 8}), y = randint(0, 5, {6});
  EXPECT_TRUE(test::throws_naming([&] { dp->forward_loss(x, y.narrow(0, 0, 4), chunk_loss); },
                                  {"forward_loss", "target's batch (4", "input's (6)"}));
  EXPECT_TRUE(test::throws_naming(
      [&] { dp->forward_loss(x, y, [](const nn::Value& out, const nn::Value&) { return out.tensor(); }); },
      {"forward_loss", "one element", "cpu:"}));
  EXPECT_TRUE(test::throws_naming(
      [&] {
        dp->forward_loss(x, y, [](const nn::Value& out, const nn::Value& t) {
          return to_device(chunk_loss(out, t), cpu_device(0));
        });
      },
      {"forward_loss", "replica on cpu:1", "is on cpu:0"}));
  EXPECT_TRUE(test::throws_naming([&] { dp->forward_loss(x, y, nullptr); }, {"no loss function"}));
  EXPECT_TRUE(test::throws_naming([&] { ReplicaLosses{}.backward(); }, {"ReplicaLosses::backward", "no losses"}));
}

}  // namespace
}  // namespace replica_losses_test
}  // namespace chorus::parallel
