// DataParallel's gradients summed by the optimizer's update (Note [Gradient
// sums in the update] in data_parallel/reducer.h; --dp-all-reduce in-update): each of
// two devices gets the other's gradients beside its own, as a pending part
// that SGD's and AdamW's fused kernels add as they read the gradient, and
// that anything else reading the gradient adds first. On two logical CPU
// devices (a plain copy stands in for the copy engines) and on two GPUs:
//  - the same training, bit for bit, as the all-reduce (NCCL, or the
//    fallback's adds): losses, weights, batch-norm buffers, replicas equal to
//    their masters, with SGD and AdamW, batches that leave a replica out;
//  - a gradient read between backward and step (Tensor::grad()) is the sum;
//    two backward passes without zero_grad accumulate the sums;
//  - parameters sharing one gradient buffer, a parameter one replica did not
//    use; replicas left out of an accumulated pass, or whose masters alone
//    were zeroed (Module::zero_grad), equal to their masters after the step;
//  - ops::exchange_each_after itself and its bad arguments; the pending-part
//    finisher (autograd/grad_finisher.h).

#include <gtest/gtest.h>

#include <chorus/autograd/grad_finisher.h>
#include <chorus/chorus.h>
#include <chorus/ops/comm.h>
#include <chorus/ops/copy.h>
#include <chorus/optim/adamw.h>
#include <chorus/optim/sgd.h>
#include <chorus/parallel/data_parallel.h>

#include <memory>
#include <string>
#include <vector>

#include "testing/compare.h"
#include "testing/devices.h"
#include "testing/nets.h"

namespace chorus::parallel {
namespace sums_in_update_test {  // names of its own in the unity build
namespace {

namespace F = nn::functional;
using test::AddedScales;
using test::UsedOnOneDevice;
using dist::GradSumMethod;
using test::rel_err;

std::unique_ptr<optim::Optimizer> make_opt(const std::vector<Tensor>& params, bool adamw) {
  if (adamw) return std::make_unique<optim::AdamW>(params, optim::AdamWOptions{.lr = 1e-2, .weight_decay = 0.01});
  return std::make_unique<optim::SGD>(
      params, optim::SGDOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3, .nesterov = true});
}

struct TrainRun {
  std::vector<double> losses;
  nn::NamedTensors state;         // the wrapped module's, after the last step
  std::vector<Tensor> grads;      // the masters' gradients after the last backward, read before step()
  double replica_diff = 0;        // the largest relative difference of a replica's parameter from its master
  uint64_t exchanges = 0;         // ops::exchange_calls() during the run
};

struct Config {
  bool adamw = false;
  int backwards = 1;              // backward passes per step (more than one: accumulated)
  int64_t later_batch = 0;        // the batch of the backward passes after the first (0: the step's)
  bool read_grads = false;        // read every master's .grad() before step()
  bool module_zero_grad = false;  // zero the wrapped module's gradients (the masters' only), not the optimizer's
  int64_t in_place_min_bytes = 0;
};

// DataParallel with replicated updates over `devices`, `method` summing.
TrainRun train(const std::shared_ptr<nn::Module>& net, const std::vector<Device>& devices, GradSumMethod method,
          const std::vector<int64_t>& batches, const Shape& input, const Config& c = {}) {
  net->to(devices[0]);
  auto dp = std::make_shared<DataParallel>(
      net, devices, DataParallelOptions{.grad_sum = method, .in_place_min_bytes = c.in_place_min_bytes});
  auto opt = make_opt(dp->parameters(), c.adamw);
  ReplicatedUpdates u = dp->replicate_updates(opt->params());
  opt->add_replicas(u.copies, u.after_step);
  manual_seed(5);
  Shape xs{12};
  xs.insert(xs.end(), input.begin(), input.end());
  Tensor x = randn(xs).to(devices[0]), y = randint(0, 5, {12}).to(devices[0]);
  TrainRun run;
  const uint64_t before = ops::exchange_calls();
  for (int64_t b : batches) {
    if (c.module_zero_grad) dp->module()->zero_grad();
    else opt->zero_grad();
    Tensor loss;
    for (int k = 0; k < c.backwards; ++k) {
      const int64_t n = k > 0 && c.later_batch > 0 ? c.later_batch : b;
      loss = F::cross_entropy(dp->forward(x.narrow(0, 0, n)), y.narrow(0, 0, n));
      loss.backward();
    }
    if (c.read_grads) {
      run.grads.clear();
      for (const Tensor& p : dp->module()->parameters()) run.grads.push_back(p.grad().defined() ? p.grad().clone() : Tensor());
    }
    opt->step();
    run.losses.push_back(loss.item());
    const auto masters = dp->module()->parameters();
    for (size_t r = 1; r < devices.size(); ++r) {
      const auto reps = dp->replica(r)->parameters();
      for (size_t i = 0; i < masters.size(); ++i)
        run.replica_diff = std::max(run.replica_diff, rel_err(reps[i].to(devices[0]), masters[i]));
    }
  }
  run.exchanges = ops::exchange_calls() - before;
  for (const auto& [n, t] : net->state_dict()) run.state.emplace_back(n, t.clone());
  return run;
}

// tol 0: bit for bit.
void expect_same(const TrainRun& got, const TrainRun& ref, double tol) {
  test::expect_same_training(got.losses, got.state, ref.losses, ref.state, tol);
  ASSERT_EQ(got.grads.size(), ref.grads.size());
  for (size_t i = 0; i < ref.grads.size(); ++i) {
    ASSERT_EQ(got.grads[i].defined(), ref.grads[i].defined()) << "gradient " << i;
    if (ref.grads[i].defined()) EXPECT_LE(rel_err(got.grads[i], ref.grads[i]), tol) << "gradient " << i;
  }
}

// Batches of 1 leave the second replica out (nothing to exchange then).
const std::vector<int64_t> kBatches{12, 12, 1, 12, 7, 12};

void check_trains_like_all_reduce(const std::vector<Device>& devices, double tol) {
  for (bool adamw : {false, true}) {
    for (int64_t min_bytes : {int64_t{0}, int64_t{400}, int64_t{1} << 20}) {
      SCOPED_TRACE(std::string(adamw ? "AdamW" : "SGD") + ", in place from " + std::to_string(min_bytes));
      const Config c{.adamw = adamw, .in_place_min_bytes = min_bytes};
      const TrainRun ref = train(test::conv_bn_net(31), devices, GradSumMethod::Nccl, kBatches, {2, 8, 8}, c);
      const TrainRun got = train(test::conv_bn_net(31), devices, GradSumMethod::InUpdate, kBatches, {2, 8, 8}, c);
      EXPECT_EQ(ref.exchanges, 0u);
      EXPECT_GT(got.exchanges, 0u);
      expect_same(got, ref, tol);
      EXPECT_EQ(got.replica_diff, 0.0);
      EXPECT_LT(got.losses.back(), got.losses.front());
    }
  }
}

TEST(SumsInUpdate, TrainLikeTheAllReduceOnTwoCpuDevices) { check_trains_like_all_reduce(test::cpus(2), 0.0); }

void check_read_and_accumulated(const std::vector<Device>& devices, double tol) {
  for (int backwards : {1, 2}) {
    SCOPED_TRACE(std::to_string(backwards) + " backward passes a step");
    const Config c{.backwards = backwards, .read_grads = true};
    const TrainRun ref = train(test::conv_bn_net(31), devices, GradSumMethod::Nccl, kBatches, {2, 8, 8}, c);
    const TrainRun got = train(test::conv_bn_net(31), devices, GradSumMethod::InUpdate, kBatches, {2, 8, 8}, c);
    EXPECT_GT(got.exchanges, 0u);
    expect_same(got, ref, tol);
    EXPECT_EQ(ref.replica_diff, 0.0);
    EXPECT_EQ(got.replica_diff, 0.0);
  }
}

TEST(SumsInUpdate, GradientsReadOrAccumulatedAreTheSums) { check_read_and_accumulated(test::cpus(2), 0.0); }

// An accumulated step whose passes use different numbers of replicas (a batch
// of 12 then of 1, and of 1 then of 12): a replica that missed a pass takes
// its master's new weights instead of stepping with part of the gradient.
TEST(SumsInUpdate, ReplicasLeftOutOfAnAccumulatedPassTakeTheirMastersWeights) {
  for (GradSumMethod m : {GradSumMethod::Nccl, GradSumMethod::InUpdate})
    for (int64_t later : {int64_t{1}, int64_t{12}}) {
      SCOPED_TRACE(std::string(dist::grad_sum_method_name(m)) + ", later passes of batch " + std::to_string(later));
      const Config c{.backwards = 2, .later_batch = later};
      const TrainRun run = train(test::conv_bn_net(31), test::cpus(2), m, kBatches, {2, 8, 8}, c);
      EXPECT_EQ(run.replica_diff, 0.0);
      EXPECT_LT(run.losses.back(), run.losses.front());
    }
}

// Module::zero_grad on the wrapped module drops the masters' gradients only:
// the replicas' gradients of the step before are replaced, not added to.
TEST(SumsInUpdate, ReplicasFollowTheirMastersWhenOnlyTheMastersAreZeroed) {
  for (GradSumMethod m : {GradSumMethod::Nccl, GradSumMethod::InUpdate})
    for (int backwards : {1, 2}) {
      SCOPED_TRACE(std::string(dist::grad_sum_method_name(m)) + ", " + std::to_string(backwards) + " backward passes");
      const Config c{.backwards = backwards, .module_zero_grad = true};
      const TrainRun run = train(test::conv_bn_net(31), test::cpus(2), m, kBatches, {2, 8, 8}, c);
      EXPECT_EQ(run.replica_diff, 0.0);
      EXPECT_LT(run.losses.back(), run.losses.front());
    }
}

void check_awkward_parameters(const std::vector<Device>& devices, double tol) {
  for (int64_t min_bytes : {int64_t{0}, int64_t{100}}) {
    SCOPED_TRACE("in place from " + std::to_string(min_bytes));
    const Config c{.in_place_min_bytes = min_bytes};
    manual_seed(17);
    const TrainRun ref = train(std::make_shared<AddedScales>(), devices, GradSumMethod::Nccl, kBatches, {2, 3, 3}, c);
    manual_seed(17);
    const TrainRun got = train(std::make_shared<AddedScales>(), devices, GradSumMethod::InUpdate, kBatches, {2, 3, 3}, c);
    expect_same(got, ref, tol);
    manual_seed(23);
    const TrainRun ref2 = train(std::make_shared<UsedOnOneDevice>(), devices, GradSumMethod::Nccl, kBatches, {2, 3, 3}, c);
    manual_seed(23);
    const TrainRun got2 =
        train(std::make_shared<UsedOnOneDevice>(), devices, GradSumMethod::InUpdate, kBatches, {2, 3, 3}, c);
    expect_same(got2, ref2, tol);
    EXPECT_EQ(got2.replica_diff, 0.0);
  }
}

TEST(SumsInUpdate, SharedAndPartlyUsedParameters) { check_awkward_parameters(test::cpus(2), 0.0); }

// Over three devices, or with the method left at auto on CPU devices, the
// gradients are all-reduced as before.
TEST(SumsInUpdate, OnlyTwoDevicesExchange) {
  auto hook = [](GradSumMethod m, bool in_place) { return dist::make_all_reduce_hook(m, in_place, test::cpus(2)); };
  EXPECT_TRUE(hook(GradSumMethod::InUpdate, true)->exchanges(test::cpus(2)));
  EXPECT_FALSE(hook(GradSumMethod::InUpdate, true)->exchanges(test::cpus(3)));
  EXPECT_FALSE(hook(GradSumMethod::InUpdate, true)->exchanges({cpu_device(0), cpu_device(0)}));
  EXPECT_FALSE(hook(GradSumMethod::Auto, true)->exchanges(test::cpus(2)));
  EXPECT_FALSE(hook(GradSumMethod::Nccl, true)->exchanges(test::cpus(2)));
  // In the update needs the gradients where they are: packed, all-reduced.
  EXPECT_FALSE(hook(GradSumMethod::InUpdate, false)->exchanges(test::cpus(2)));
  EXPECT_FALSE(hook(GradSumMethod::InUpdate, false)->sums_each());
  EXPECT_TRUE(hook(GradSumMethod::InUpdate, false)->all_reduces());
  const TrainRun three = train(test::conv_bn_net(31), test::cpus(3), GradSumMethod::InUpdate, {12, 12}, {2, 8, 8});
  EXPECT_EQ(three.exchanges, 0u);
  EXPECT_EQ(three.replica_diff, 0.0);
}

Tensor random_on(const Shape& s, const Device& d, uint64_t seed) {
  manual_seed(seed);
  return randn(s).to(d);
}

TEST(SumsInUpdate, ExchangeCopiesTheOtherDevicesBuffersInTheirLayout) {
  const auto devs = test::cpus(2);
  Event e0(devs[0], false), e1(devs[1], false);
  e0.record();
  e1.record();
  // A channels-last 4-d gradient and a 1-d one.
  std::vector<std::vector<Tensor>> bufs(2);
  for (size_t i = 0; i < 2; ++i) {
    bufs[0].push_back(ops::to_channels_last(random_on({3, 4, 2, 5}, devs[i], 10 + i)));
    bufs[1].push_back(random_on({7}, devs[i], 20 + i));
  }
  const auto parts = ops::exchange_each_after(bufs, {e0, e1});
  ASSERT_EQ(parts.size(), 2u);
  for (size_t t = 0; t < 2; ++t)
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(parts[t][i].device(), devs[i]);
      EXPECT_EQ(parts[t][i].strides(), bufs[t][i].strides());
      EXPECT_EQ(rel_err(parts[t][i], bufs[t][1 - i].to(devs[i])), 0.0);
    }
  // Bad arguments: three devices, one buffer, mismatched layouts.
  Event e2(cpu_device(2), false);
  e2.record();
  EXPECT_THROW(ops::exchange_each_after(bufs, {e0, e1, e2}), ValueError);
  std::vector<std::vector<Tensor>> one{{bufs[1][0]}};
  EXPECT_THROW(ops::exchange_each_after(one, {e0, e1}), ValueError);
  std::vector<std::vector<Tensor>> mixed{{bufs[0][0], bufs[0][1].contiguous()}};
  EXPECT_THROW(ops::exchange_each_after(mixed, {e0, e1}), ValueError);
}

TEST(SumsInUpdate, APendingPartIsAddedOnceWhenRead) {
  Tensor p = random_on({6}, cpu_device(0), 1).requires_grad_();
  Tensor g = random_on({6}, cpu_device(0), 2), part = random_on({6}, cpu_device(0), 3);
  const Tensor want = g + part;
  autograd::set_pending_sum(g, part);
  EXPECT_THROW(autograd::set_pending_sum(g, part), ValueError);                      // one part at a time
  EXPECT_THROW(autograd::set_pending_sum(part, random_on({5}, cpu_device(0), 4)), ValueError);  // shape
  p.set_grad(g);
  EXPECT_TRUE(autograd::pending_part(autograd::unfinished_grad(p)).defined());
  EXPECT_EQ(rel_err(p.grad(), want), 0.0);  // finished by the read
  EXPECT_FALSE(autograd::pending_part(g).defined());
  EXPECT_EQ(rel_err(p.grad(), want), 0.0);  // and not added twice
}

#ifdef CHORUS_WITH_CUDA
std::vector<Device> two_gpus() { return {cuda_device(0), cuda_device(1)}; }

// NCCL's sum of two ranks rounds each element once, as the update's addition
// does: the same bits.
TEST(SumsInUpdate, TrainLikeNcclOnTwoGpus_MultiCUDA) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  if (!ops::exchange_possible(two_gpus())) GTEST_SKIP() << "no peer access between cuda:0 and cuda:1";
  check_trains_like_all_reduce(two_gpus(), 0.0);
  check_read_and_accumulated(two_gpus(), 0.0);
  check_awkward_parameters(two_gpus(), 0.0);
}

TEST(SumsInUpdate, ExchangeOnTwoGpus_MultiCUDA) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  if (!ops::exchange_possible(two_gpus())) GTEST_SKIP() << "no peer access between cuda:0 and cuda:1";
  const auto devs = two_gpus();
  std::vector<std::vector<Tensor>> bufs(2);
  std::vector<Event> ready;
  for (size_t i = 0; i < 2; ++i) {
    bufs[0].push_back(ops::to_channels_last(random_on({64, 32, 3, 3}, devs[i], 30 + i)));
    bufs[1].push_back(random_on({1000003}, devs[i], 40 + i));
    ready.emplace_back(devs[i], false);
    ready.back().record();
  }
  const auto parts = ops::exchange_each_after(bufs, ready);
  for (const Device& d : devs) ops::comm_join(d);
  for (size_t t = 0; t < 2; ++t)
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(parts[t][i].device(), devs[i]);
      EXPECT_EQ(rel_err(parts[t][i].to(cpu_device(0)), bufs[t][1 - i].to(cpu_device(0))), 0.0);
    }
}
#endif

}  // namespace
}  // namespace sums_in_update_test
}  // namespace chorus::parallel
