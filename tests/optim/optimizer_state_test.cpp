// Optimizer::state() / load_state(): a restored optimizer continues exactly
// (bitwise) as the original would have, and bad snapshots are refused whole;
// live_state() holds the buffers that the next step changes.
#include <gtest/gtest.h>

#include <functional>
#include <memory>

#include "chorus/core/error.h"
#include "chorus/ops/copy.h"
#include "chorus/optim/adamw.h"
#include "chorus/optim/sgd.h"
#include "optim/optim_reference.h"

namespace chorus::optim {
namespace {

using namespace testing;
using MakeOptimizer = std::function<std::unique_ptr<Optimizer>(std::vector<Tensor>)>;

std::vector<Tensor> make_params(uint32_t seed) {
  return {param_of(random_vec(12, seed), {3, 4}), param_of(random_vec(5, seed + 1), {5}),
          param_of(random_vec(6, seed + 2), {6})};
}

std::vector<Tensor> copy_params(const std::vector<Tensor>& src) {
  std::vector<Tensor> out;
  for (const Tensor& p : src) out.push_back(ops::clone(p.detach()).set_requires_grad(true));
  return out;
}

// Step `steps` times with deterministic gradients derived from (step, k);
// parameter 2 never gets a gradient before step 2, so it has no state early.
void train(Optimizer& opt, std::vector<Tensor>& params, int first_step, int steps) {
  for (int s = first_step; s < first_step + steps; ++s) {
    opt.zero_grad();
    for (size_t k = 0; k < params.size(); ++k) {
      if (k == 2 && s < 2) continue;
      params[k].set_grad(from_vector(random_vec(params[k].numel(), 500 + 7 * s + k), params[k].sizes()));
    }
    opt.step();
  }
}

void check_round_trip(const MakeOptimizer& make) {
  std::vector<Tensor> a = make_params(1);
  auto opt_a = make(a);
  train(*opt_a, a, 0, 2);  // parameter 2 still has no state
  opt_a->set_lr(opt_a->lr() * 0.7);

  // Restore into a fresh optimizer over copied parameters, then continue both.
  NamedTensors snapshot = opt_a->state();
  std::vector<Tensor> b = copy_params(a);
  auto opt_b = make(b);
  opt_b->load_state(snapshot);
  EXPECT_EQ(opt_b->step_count(), 2);
  EXPECT_EQ(opt_b->lr(), opt_a->lr());

  train(*opt_a, a, 2, 4);
  train(*opt_b, b, 2, 4);
  for (size_t k = 0; k < a.size(); ++k) EXPECT_EQ(values(a[k]), values(b[k])) << "param " << k;
  // The snapshot was a copy: continuing opt_a did not change it.
  NamedTensors later = opt_a->state();
  ASSERT_GT(later.size(), snapshot.size());
}

TEST(OptimizerState, SGDRoundTripGivesIdenticalSteps) {
  check_round_trip([](std::vector<Tensor> p) {
    return std::make_unique<SGD>(p, SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-3, .nesterov = true});
  });
}

TEST(OptimizerState, AdamWRoundTripGivesIdenticalSteps) {
  check_round_trip([](std::vector<Tensor> p) { return std::make_unique<AdamW>(p, AdamWOptions{.lr = 0.01}); });
}

TEST(OptimizerState, NamesFollowTheDocumentedScheme) {
  std::vector<Tensor> p = make_params(3);
  AdamW opt(p, {});
  train(opt, p, 0, 1);
  std::vector<std::string> names;
  for (auto& [n, t] : opt.state()) names.push_back(n);
  const std::vector<std::string> want = {"step", "lr", "param.0.step", "param.0.exp_avg", "param.0.exp_avg_sq",
                                         "param.1.step", "param.1.exp_avg", "param.1.exp_avg_sq"};
  EXPECT_EQ(names, want);
}

// live_state() names what state() does, holding the live buffers: the
// next step changes them, and state()'s copies stay as they were.
TEST(OptimizerState, LiveStateHoldsTheBuffersThemselves) {
  std::vector<Tensor> p = make_params(5);
  AdamW opt(p, {});
  train(opt, p, 0, 2);
  const NamedTensors live = opt.live_state(), copied = opt.state();
  ASSERT_EQ(live.size(), copied.size());
  std::vector<Vec> before(live.size());
  for (size_t i = 0; i < live.size(); ++i) {
    EXPECT_EQ(live[i].first, copied[i].first);
    if (live[i].first.find("exp_avg") == std::string::npos) continue;  // the scalars are new tensors either way
    before[i] = values(copied[i].second);
    EXPECT_EQ(values(live[i].second), before[i]) << live[i].first;
  }
  train(opt, p, 2, 1);
  for (size_t i = 0; i < live.size(); ++i) {
    if (before[i].empty()) continue;
    EXPECT_NE(values(live[i].second), before[i]) << live[i].first;
    EXPECT_EQ(values(copied[i].second), before[i]) << copied[i].first;
  }
}

TEST(OptimizerState, RejectsMismatchedSnapshotsAndStaysUnchanged) {
  std::vector<Tensor> p = make_params(4);
  SGD opt(p, {.lr = 0.1, .momentum = 0.9});
  train(opt, p, 0, 3);
  const NamedTensors good = opt.state();
  auto with = [&](const std::string& key, Tensor t) {
    NamedTensors s = good;
    bool replaced = false;
    for (auto& [n, v] : s)
      if (n == key) v = t, replaced = true;
    if (!replaced) s.emplace_back(key, t);
    return s;
  };
  expect_throw_with<ValueError>([&] { opt.load_state(with("param.0.exp_avg", zeros({3, 4}))); },
                                "SGD keeps no 'exp_avg'");
  expect_throw_with<ValueError>([&] { opt.load_state(with("param.7.momentum_buffer", zeros({3, 4}))); },
                                "names parameter 7 but there are 3");
  expect_throw_with<ValueError>([&] { opt.load_state(with("param.0.momentum_buffer", zeros({4, 3}))); },
                                "'param.0.momentum_buffer' is float32[4, 3]");
  expect_throw_with<ValueError>([&] { opt.load_state(with("bogus", zeros({1}))); }, "unexpected key 'bogus'");

  // Issue 15: an optimizer file with no tensors, or without a momentum
  // buffer, was accepted and momentum silently restarted.
  expect_throw_with<ValueError>([&] { opt.load_state({}); }, "no 'step'");
  NamedTensors no_momentum;
  for (auto& [n, t] : good)
    if (n != "param.2.momentum_buffer") no_momentum.emplace_back(n, t);
  expect_throw_with<ValueError>([&] { opt.load_state(no_momentum); }, "param.2.momentum_buffer is missing");
  SGD plain(p, {.lr = 0.1});  // no momentum: no buffers, and a snapshot with one does not fit
  train(plain, p, 0, 2);
  EXPECT_NO_THROW(plain.load_state(plain.state()));
  expect_throw_with<ValueError>([&] { plain.load_state(good); }, "SGD keeps no 'momentum_buffer'");

  AdamW adam(p, {});
  train(adam, p, 0, 3);
  NamedTensors partial;
  for (auto& [n, t] : adam.state())
    if (n != "param.1.exp_avg_sq") partial.emplace_back(n, t);
  AdamW fresh(p, {});
  expect_throw_with<ValueError>([&] { fresh.load_state(partial); }, "param.1.exp_avg_sq is missing");
  EXPECT_EQ(fresh.step_count(), 0) << "a refused snapshot must leave the optimizer unchanged";
  EXPECT_EQ(fresh.state().size(), 2u);
}

}  // namespace
}  // namespace chorus::optim
