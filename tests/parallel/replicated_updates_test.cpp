// DataParallel with replicated updates (Note [Replicated updates] in
// parallel/data_parallel.h) and the optimizer's replicas (Note [Optimizer
// replicas] in optim/optimizer.h), on logical CPU devices: the same training
// as DataParallel broadcasting the new weights (losses, weights, batch-norm
// buffers), with SGD and AdamW, across batches smaller than the device count;
// the replicas equal to their masters right after step() (with broadcasts
// they are stale until the next forward); no copy at the forward; eval mode,
// a loaded checkpoint and a resumed optimizer; bad arguments.

#include <gtest/gtest.h>

#include <chorus/chorus.h>
#include <chorus/optim/adamw.h>
#include <chorus/optim/sgd.h>
#include <chorus/parallel/data_parallel.h>

#include <memory>
#include <string>
#include <vector>

#include "testing/devices.h"
#include "testing/nets.h"
#include "testing/compare.h"

namespace chorus::parallel {
namespace replicated_updates_test {  // names of its own in the unity build
namespace {

namespace F = nn::functional;
using test::rel_err;

constexpr double kTol = 1e-5;

using test::cpus;

std::shared_ptr<nn::Sequential> make_net() { return test::conv_bn_net(31); }

enum class Updates { Broadcast, Replicated };

struct StepsRun {
  std::vector<double> losses;
  nn::NamedTensors state;             // the wrapped module's, after the last step
  std::vector<double> replica_diff;   // per step: the largest relative difference of a replica's
                                      // parameter from its master, right after step()
};

std::unique_ptr<optim::Optimizer> make_opt(const std::vector<Tensor>& params, bool adamw) {
  if (adamw) return std::make_unique<optim::AdamW>(params, optim::AdamWOptions{.lr = 1e-2, .weight_decay = 0.01});
  return std::make_unique<optim::SGD>(
      params, optim::SGDOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3, .nesterov = true});
}

double largest_replica_diff(const DataParallel& dp) {
  const auto masters = dp.module()->parameters();
  double worst = 0;
  for (size_t r = 1; r < dp.devices().size(); ++r) {
    const auto reps = dp.replica(r)->parameters();
    for (size_t i = 0; i < masters.size(); ++i) worst = std::max(worst, rel_err(reps[i], masters[i]));
  }
  return worst;
}

StepsRun train(Updates updates, int devices, bool adamw, const std::vector<int64_t>& batches) {
  auto net = make_net();
  auto dp = std::make_shared<DataParallel>(net, cpus(devices));
  auto opt = make_opt(dp->parameters(), adamw);
  if (updates == Updates::Replicated) {
    ReplicatedUpdates u = dp->replicate_updates(opt->params());
    opt->add_replicas(u.copies, u.after_step);
  }
  manual_seed(5);
  Tensor x = randn({12, 2, 8, 8}), y = randint(0, 5, {12});
  StepsRun run;
  for (int64_t b : batches) {
    opt->zero_grad();
    Tensor loss = F::cross_entropy(dp->forward(x.narrow(0, 0, b)), y.narrow(0, 0, b));
    loss.backward();
    opt->step();
    run.losses.push_back(loss.item());
    run.replica_diff.push_back(largest_replica_diff(*dp));
  }
  for (const auto& [n, t] : net->state_dict()) run.state.emplace_back(n, t.clone());
  return run;
}

void expect_same(const StepsRun& got, const StepsRun& ref) {
  ASSERT_EQ(got.losses.size(), ref.losses.size());
  for (size_t i = 0; i < ref.losses.size(); ++i)
    EXPECT_NEAR(got.losses[i], ref.losses[i], kTol * std::abs(ref.losses[i])) << "step " << i;
  ASSERT_EQ(got.state.size(), ref.state.size());
  for (size_t i = 0; i < ref.state.size(); ++i)
    EXPECT_LE(rel_err(got.state[i].second, ref.state[i].second), kTol) << ref.state[i].first;
}

TEST(ReplicatedUpdates, TrainLikeBroadcastsAndKeepTheReplicasEqual) {
  // Batches of 1 and 2 leave replicas out of a step (they get the master's
  // value and state copied), the others use every device.
  const std::vector<int64_t> batches{12, 12, 1, 12, 2, 12, 7};
  for (bool adamw : {false, true}) {
    for (int devices : {2, 3}) {
      SCOPED_TRACE(std::string(adamw ? "AdamW" : "SGD") + ", " + std::to_string(devices) + " devices");
      const StepsRun ref = train(Updates::Broadcast, devices, adamw, batches);
      const StepsRun got = train(Updates::Replicated, devices, adamw, batches);
      expect_same(got, ref);
      EXPECT_LT(ref.losses.back(), ref.losses.front());
      for (size_t i = 0; i < got.replica_diff.size(); ++i) EXPECT_EQ(got.replica_diff[i], 0.0) << "step " << i;
      // Without replicated updates the replicas lag until the next forward:
      // the check above can fail.
      EXPECT_GT(ref.replica_diff[0], 0.0);
    }
  }
}

// A forward after a replicated step copies nothing to the replicas: the
// optimizer keeps them. Shown by spoiling replica 1's weights by hand (which
// replicated updates do not watch for, Note [Replicated updates]): with
// broadcasts the forward repairs them, with replicated updates it does not.
TEST(ReplicatedUpdates, TheForwardCopiesNoWeights) {
  for (Updates updates : {Updates::Broadcast, Updates::Replicated}) {
    SCOPED_TRACE(updates == Updates::Replicated ? "replicated" : "broadcast");
    manual_seed(3);
    auto mlp = std::make_shared<nn::Sequential>();
    mlp->push_back(std::make_shared<nn::Linear>(6, 8));
    mlp->push_back(std::make_shared<nn::ReLU>());
    mlp->push_back(std::make_shared<nn::Linear>(8, 3));
    auto dp = std::make_shared<DataParallel>(mlp, cpus(2));
    optim::SGD opt(dp->parameters(), {.lr = 0.1, .momentum = 0.9});
    if (updates == Updates::Replicated) {
      ReplicatedUpdates u = dp->replicate_updates(opt.params());
      opt.add_replicas(u.copies, u.after_step);
    }
    Tensor x = randn({8, 6}), y = randint(0, 3, {8});
    for (int i = 0; i < 2; ++i) {
      opt.zero_grad();
      F::cross_entropy(dp->forward(x), y).backward();
      opt.step();
    }
    NoGradGuard ng;
    for (Tensor p : dp->replica(1)->parameters()) p.fill_(0.0);
    const double err = rel_err(dp->forward(x), mlp->forward(x));
    if (updates == Updates::Replicated)
      EXPECT_GT(err, 0.01) << "the forward copied the weights to the replica";
    else
      EXPECT_LE(err, kTol) << "the broadcast should have repaired the replica";
  }
}

// Eval mode: the replicas normalise with the master's running statistics,
// which replicated training does not broadcast while it trains.
TEST(ReplicatedUpdates, EvalUsesTheMastersRunningStatistics) {
  auto net = make_net();
  auto dp = std::make_shared<DataParallel>(net, cpus(3));
  optim::SGD opt(dp->parameters(), {.lr = 0.05, .momentum = 0.9});
  ReplicatedUpdates u = dp->replicate_updates(opt.params());
  opt.add_replicas(u.copies, u.after_step);
  manual_seed(8);
  Tensor x = randn({9, 2, 8, 8}), y = randint(0, 5, {9});
  for (int i = 0; i < 3; ++i) {
    opt.zero_grad();
    F::cross_entropy(dp->forward(x), y).backward();
    opt.step();
  }
  dp->eval();
  NoGradGuard ng;
  EXPECT_LE(rel_err(dp->forward(x), net->forward(x)), kTol);
}

// Weights changed outside the optimizer still reach the replicas.
TEST(ReplicatedUpdates, ALoadedCheckpointReachesTheReplicas) {
  auto other = make_net();
  for (auto& p : other->parameters()) {
    NoGradGuard ng;
    p.mul_(1.5);
  }
  auto net = make_net();
  auto dp = std::make_shared<DataParallel>(net, cpus(2));
  optim::SGD opt(dp->parameters(), {.lr = 0.05});
  ReplicatedUpdates u = dp->replicate_updates(opt.params());
  opt.add_replicas(u.copies, u.after_step);
  manual_seed(9);
  Tensor x = randn({6, 2, 8, 8}), y = randint(0, 5, {6});
  opt.zero_grad();
  F::cross_entropy(dp->forward(x), y).backward();
  opt.step();
  dp->load_state_dict(other->state_dict());
  dp->eval();
  other->eval();
  NoGradGuard ng;
  EXPECT_LE(rel_err(dp->forward(x), other->forward(x)), kTol);
}

// The optimizer's snapshot speaks of its parameters only, and a restored
// optimizer gives its replicas the restored state: 2 + 2 steps with a resume
// between them equal 4 steps.
TEST(ReplicatedUpdates, AResumedOptimizerGivesItsReplicasTheState) {
  for (bool adamw : {false, true}) {
    SCOPED_TRACE(adamw ? "AdamW" : "SGD");
    manual_seed(6);
    Tensor x = randn({8, 2, 8, 8}), y = randint(0, 5, {8});
    auto setup = [&](std::shared_ptr<nn::Sequential>* net, std::shared_ptr<DataParallel>* dp,
                     std::unique_ptr<optim::Optimizer>* opt) {
      *net = make_net();
      *dp = std::make_shared<DataParallel>(*net, cpus(2));
      *opt = make_opt((*dp)->parameters(), adamw);
      ReplicatedUpdates u = (*dp)->replicate_updates((*opt)->params());
      (*opt)->add_replicas(u.copies, u.after_step);
    };
    auto steps = [&](DataParallel& dp, optim::Optimizer& opt, int n) {
      for (int i = 0; i < n; ++i) {
        opt.zero_grad();
        F::cross_entropy(dp.forward(x), y).backward();
        opt.step();
      }
    };
    std::shared_ptr<nn::Sequential> net_a, net_b;
    std::shared_ptr<DataParallel> dp_a, dp_b;
    std::unique_ptr<optim::Optimizer> opt_a, opt_b;
    setup(&net_a, &dp_a, &opt_a);
    steps(*dp_a, *opt_a, 2);
    const NamedTensors snap = opt_a->state();
    for (const auto& [name, t] : snap)
      if (name.rfind("param.", 0) == 0)
        EXPECT_LT(std::stoul(name.substr(6)), opt_a->params().size()) << name << " names a replica";
    nn::NamedTensors weights;
    for (const auto& [n, t] : net_a->state_dict()) weights.emplace_back(n, t.clone());
    steps(*dp_a, *opt_a, 2);
    setup(&net_b, &dp_b, &opt_b);
    net_b->load_state_dict(weights);
    opt_b->load_state(snap);
    steps(*dp_b, *opt_b, 2);
    const auto a = net_a->state_dict(), b = net_b->state_dict();
    for (size_t i = 0; i < a.size(); ++i) EXPECT_LE(rel_err(b[i].second, a[i].second), kTol) << a[i].first;
    EXPECT_EQ(largest_replica_diff(*dp_b), 0.0);
  }
}

// Two optimizers over two halves of the parameters, each with its replicas:
// the same training as one optimizer over all of them.
TEST(ReplicatedUpdates, TwoOptimizersEachStepTheirOwnReplicas) {
  auto run = [](bool split) {
    auto net = make_net();
    auto dp = std::make_shared<DataParallel>(net, cpus(2));
    const std::vector<Tensor> all = dp->parameters();
    const std::vector<Tensor> a(all.begin(), all.begin() + 2), b(all.begin() + 2, all.end());
    std::vector<std::unique_ptr<optim::Optimizer>> opts;
    for (const auto& part : split ? std::vector<std::vector<Tensor>>{a, b} : std::vector<std::vector<Tensor>>{all}) {
      opts.push_back(make_opt(part, false));
      ReplicatedUpdates u = dp->replicate_updates(opts.back()->params());
      opts.back()->add_replicas(u.copies, u.after_step);
    }
    manual_seed(4);
    Tensor x = randn({8, 2, 8, 8}), y = randint(0, 5, {8});
    for (int i = 0; i < 3; ++i) {
      for (auto& o : opts) o->zero_grad();
      F::cross_entropy(dp->forward(x), y).backward();
      for (auto& o : opts) o->step();
    }
    EXPECT_EQ(largest_replica_diff(*dp), 0.0);
    nn::NamedTensors out;
    for (const auto& [n, t] : net->state_dict()) out.emplace_back(n, t.clone());
    return out;
  };
  const nn::NamedTensors one = run(false), two = run(true);
  for (size_t i = 0; i < one.size(); ++i) EXPECT_LE(rel_err(two[i].second, one[i].second), kTol) << one[i].first;
}

TEST(ReplicatedUpdates, BadArgumentsAreValueErrors) {
  auto net = make_net();
  auto dp = std::make_shared<DataParallel>(net, cpus(2));
  optim::SGD opt(dp->parameters(), {.lr = 0.05});
  Tensor stranger = randn({3, 3});
  EXPECT_THROW(dp->replicate_updates({stranger}), ValueError);
  const Tensor p0 = opt.params()[0];
  EXPECT_THROW(opt.add_replicas({{opt.params().size(), zeros(p0.sizes())}}), ValueError);  // out of range
  EXPECT_THROW(opt.add_replicas({{0, zeros({1})}}), ValueError);                          // wrong shape
  EXPECT_THROW(opt.add_replicas({{1, opt.params()[1]}}), ValueError);                     // a parameter
  Tensor copy = zeros(p0.sizes());
  EXPECT_THROW(opt.add_replicas({{0, copy}, {0, copy}}), ValueError);                     // twice
  EXPECT_EQ(opt.num_replicas(), 0u);  // nothing half-added
}

}  // namespace
}  // namespace replicated_updates_test
}  // namespace chorus::parallel
