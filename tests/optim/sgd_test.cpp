// SGD against a double re-implementation of torch.optim.SGD over several steps
// (momentum, dampening, Nesterov, weight decay, a parameter that sometimes has
// no gradient, a strided parameter, an lr change mid-run), plus the one-step
// closed form and the hyper-parameter checks.
#include "chorus/optim/sgd.h"

#include <gtest/gtest.h>

#include <memory>

#include "chorus/core/error.h"
#include "optim/optim_reference.h"

namespace chorus::optim {
namespace {

using namespace testing;

// A channels-last (NHWC) weight, as Module::to_channels_last() leaves it, is
// updated in place, keeps its layout, and its momentum state takes the layout
// too -- the same numbers as a contiguous copy of it.
TEST(SGD, ChannelsLastParameterIsUpdatedInPlace) {
  const Shape s{4, 3, 2, 5};
  const Vec p0 = random_vec(numel_of(s), 7);
  Tensor a = param_of(p0, s);
  Tensor b = from_vector(p0, s).permute({0, 2, 3, 1}).contiguous().permute({0, 3, 1, 2});
  b.set_requires_grad(true);
  const Shape strides = b.strides();
  const void* data = b.raw_data();
  const SGDOptions o{.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-2, .nesterov = true};
  SGD oa({a}, o), ob({b}, o);
  for (int step = 0; step < 3; ++step) {
    const Vec g = random_vec(numel_of(s), 20 + step);
    a.set_grad(from_vector(g, s));
    b.set_grad(from_vector(g, s));  // contiguous: brought to b's layout
    oa.step();
    ob.step();
  }
  EXPECT_EQ(b.strides(), strides);
  EXPECT_EQ(b.raw_data(), data);
  expect_close(values(b), values(a), 0, "channels-last vs contiguous");
  // The state round-trips through state()/load_state() (contiguous on the way
  // out, as checkpoints store it) and the next step still agrees.
  SGD oc({b}, o);
  oc.load_state(ob.state());
  const Vec g = random_vec(numel_of(s), 40);
  a.set_grad(from_vector(g, s));
  b.set_grad(from_vector(g, s));
  oa.step();
  oc.step();
  expect_close(values(b), values(a), 0, "after load_state");
}

TEST(SGD, OneStepIsParamMinusLrTimesGrad) {
  const Vec p0 = random_vec(12, 1), g = random_vec(12, 2);
  Tensor p = param_of(p0, {3, 4});
  p.set_grad(from_vector(g, {3, 4}));
  SGD opt({p}, SGDOptions{.lr = 0.1});
  opt.step();
  Vec want(12);
  for (size_t i = 0; i < 12; ++i) want[i] = p0[i] - 0.1 * g[i];
  expect_close(values(p), want, 1e-7, "p - lr*g");
  EXPECT_EQ(opt.step_count(), 1);
}

void run_against_reference(const SGDOptions& o, const std::string& what) {
  SCOPED_TRACE(what);
  // Shapes: a matrix, a vector, a transposed matrix (dense, not contiguous:
  // updated through flat views, Note [Optimizer layouts]) and a column slice
  // (not dense: updated through a contiguous copy).
  const std::vector<Shape> shapes = {{3, 5}, {7}, {4, 3}, {3, 8}};
  std::vector<Tensor> params;
  std::vector<Vec> ref_p;
  std::vector<RefSGD> ref;
  for (size_t k = 0; k < shapes.size(); ++k) {
    Vec v = random_vec(numel_of(shapes[k]), 10 + k);
    Tensor p = from_vector(v, shapes[k]);
    if (k == 2) p = p.t();               // a permuted view as the parameter
    if (k == 3) p = p.narrow(1, 2, 4);   // a strided slice as the parameter
    p.set_requires_grad(true);
    params.push_back(p);
    ref_p.push_back(values(p));
    ref.push_back(RefSGD{o.lr, o.momentum, o.dampening, o.weight_decay, o.nesterov, {}});
  }
  SGD opt(params, o);
  for (int step = 0; step < 6; ++step) {
    if (step == 3) {  // as a schedule would
      opt.set_lr(o.lr * 0.5);
      for (auto& r : ref) r.lr = o.lr * 0.5;
    }
    opt.zero_grad();
    for (size_t k = 0; k < params.size(); ++k) {
      // Parameter 1 has no gradient at steps 0 and 3: skipped, state untouched.
      if (k == 1 && (step == 0 || step == 3)) continue;
      Vec g = random_vec(params[k].numel(), 100 * step + k);
      params[k].set_grad(from_vector(g, params[k].sizes()));
      ref[k].step(ref_p[k], g);
    }
    const uint32_t v0 = params[0].version();
    opt.step();
    EXPECT_GT(params[0].version(), v0) << "the update must bump the parameter's version";
    for (size_t k = 0; k < params.size(); ++k)
      expect_close(values(params[k]), ref_p[k], 2e-6, "param " + std::to_string(k) + " step " + std::to_string(step));
  }
  EXPECT_EQ(opt.step_count(), 6);
}

TEST(SGD, MatchesPyTorchFormulasOverSeveralSteps) {
  run_against_reference({.lr = 0.1}, "plain");
  run_against_reference({.lr = 0.1, .weight_decay = 0.05}, "weight decay");
  run_against_reference({.lr = 0.05, .momentum = 0.9}, "momentum");
  run_against_reference({.lr = 0.05, .momentum = 0.8, .dampening = 0.3, .weight_decay = 1e-2}, "dampened");
  run_against_reference({.lr = 0.1, .momentum = 0.9, .weight_decay = 5e-4, .nesterov = true}, "nesterov (WRN recipe)");
}

TEST(SGD, ParameterWithoutGradientIsUntouched) {
  const Vec v = random_vec(6, 3);
  Tensor p = param_of(v, {6});
  SGD opt({p}, {.lr = 0.1, .momentum = 0.9});
  const uint32_t v0 = p.version();
  opt.step();
  EXPECT_EQ(values(p), v);
  EXPECT_EQ(p.version(), v0);
  // No state was created for it: the snapshot has only the global entries.
  EXPECT_EQ(opt.state().size(), 2u);
}

TEST(SGD, RejectsBadHyperParameters) {
  auto params = [] { return std::vector<Tensor>{param_of(random_vec(4, 1), {4})}; };
  expect_throw_with<ValueError>([&] { SGD(params(), {.lr = -0.1}); }, "SGD: learning rate must be >= 0, got -0.1");
  expect_throw_with<ValueError>([&] { SGD(params(), {.lr = 0.1, .momentum = -0.5}); },
                                "SGD: momentum must be >= 0, got -0.5");
  expect_throw_with<ValueError>([&] { SGD(params(), {.lr = 0.1, .weight_decay = -1}); },
                                "SGD: weight decay must be >= 0, got -1");
  expect_throw_with<ValueError>([&] { SGD(params(), {.lr = 0.1, .nesterov = true}); },
                                "SGD: Nesterov momentum requires momentum > 0 and dampening 0");
  expect_throw_with<ValueError>([&] { SGD(params(), {.lr = 0.1, .momentum = 0.9, .dampening = 0.1, .nesterov = true}); },
                                "dampening 0.1");
  expect_throw_with<ValueError>([&] { SGD({}, {.lr = 0.1}); }, "SGD: got an empty parameter list");
  Tensor p = param_of(random_vec(4, 1), {4});
  expect_throw_with<ValueError>([&] { SGD({p, p}, {.lr = 0.1}); }, "appears more than once");
  SGD opt(params(), {.lr = 0.1});
  expect_throw_with<ValueError>([&] { opt.set_lr(-1); }, "SGD: learning rate must be >= 0, got -1");
}

TEST(SGD, RequiresFloat32MasterWeights) {
  Tensor half = from_vector(random_vec(4, 1), {4}, TensorOptions(kBFloat16));
  half.set_requires_grad(true);
  expect_throw_with<ValueError>([&] { SGD({half}, {.lr = 0.1}); }, "SGD: parameter 0 is bfloat16");
}

TEST(SGD, GpuMatchesCpu_CUDA) {
  expect_gpu_matches_cpu([](std::vector<Tensor> p) {
    return std::make_unique<SGD>(p, SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 5e-4, .nesterov = true});
  });
}

}  // namespace
}  // namespace chorus::optim
