// AdamW against a double re-implementation of torch.optim.AdamW over several
// steps, including a parameter whose gradient is missing on some steps (its
// bias correction then follows its own step count, as in PyTorch), and the
// hyper-parameter checks.
#include "chorus/optim/adamw.h"

#include <gtest/gtest.h>

#include <memory>

#include "chorus/core/error.h"
#include "optim/optim_reference.h"

namespace chorus::optim {
namespace {

using namespace testing;

void run_against_reference(const AdamWOptions& o, const std::string& what) {
  SCOPED_TRACE(what);
  const std::vector<Shape> shapes = {{4, 6}, {9}, {2, 3, 2}};
  std::vector<Tensor> params;
  std::vector<Vec> ref_p;
  std::vector<RefAdamW> ref;
  for (size_t k = 0; k < shapes.size(); ++k) {
    Vec v = random_vec(numel_of(shapes[k]), 20 + k);
    params.push_back(param_of(v, shapes[k]));
    ref_p.push_back(v);
    ref.push_back(RefAdamW{o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, {}, {}});
  }
  AdamW opt(params, o);
  for (int step = 0; step < 8; ++step) {
    opt.zero_grad();
    for (size_t k = 0; k < params.size(); ++k) {
      // Parameter 2 first gets gradients at step 2, and misses step 5.
      if (k == 2 && (step < 2 || step == 5)) continue;
      // Scaled gradients: the update must not depend on the scale only through eps.
      Vec g = random_vec(params[k].numel(), 1000 + 10 * step + k);
      for (double& e : g) e = static_cast<float>(e * (k + 1) * 0.3);
      params[k].set_grad(from_vector(g, params[k].sizes()));
      ref[k].step(ref_p[k], g);
    }
    opt.step();
    for (size_t k = 0; k < params.size(); ++k)
      expect_close(values(params[k]), ref_p[k], 5e-6, "param " + std::to_string(k) + " step " + std::to_string(step));
  }
  EXPECT_EQ(opt.step_count(), 8);
}

TEST(AdamW, MatchesPyTorchFormulasOverSeveralSteps) {
  run_against_reference({}, "defaults (lr 1e-3, wd 0.01)");
  run_against_reference({.lr = 0.01, .beta1 = 0.8, .beta2 = 0.95, .eps = 1e-6, .weight_decay = 0.1}, "custom");
  run_against_reference({.lr = 0.003, .beta1 = 0.0, .beta2 = 0.5, .eps = 1e-8, .weight_decay = 0}, "no momentum, no decay");
}

TEST(AdamW, RejectsBadHyperParameters) {
  auto params = [] { return std::vector<Tensor>{param_of(random_vec(4, 1), {4})}; };
  expect_throw_with<ValueError>([&] { AdamW(params(), {.lr = -0.1}); }, "AdamW: learning rate must be >= 0, got -0.1");
  expect_throw_with<ValueError>([&] { AdamW(params(), {.beta1 = 1.0}); }, "AdamW: beta1 must be in [0, 1), got 1");
  expect_throw_with<ValueError>([&] { AdamW(params(), {.beta2 = -0.1}); }, "AdamW: beta2 must be in [0, 1), got -0.1");
  expect_throw_with<ValueError>([&] { AdamW(params(), {.eps = 0}); }, "AdamW: eps must be > 0, got 0");
  expect_throw_with<ValueError>([&] { AdamW(params(), {.weight_decay = -0.01}); },
                                "AdamW: weight decay must be >= 0, got -0.01");
  Tensor half = from_vector(random_vec(4, 1), {4}, TensorOptions(kFloat16));
  expect_throw_with<ValueError>([&] { AdamW({half}, {}); }, "AdamW: parameter 0 is float16");
}

TEST(AdamW, GpuMatchesCpu_CUDA) {
  expect_gpu_matches_cpu([](std::vector<Tensor> p) { return std::make_unique<AdamW>(p, AdamWOptions{.lr = 0.01}); });
}

}  // namespace
}  // namespace chorus::optim
