// Optimizers on float64 parameters (CPU): the double-precision reference runs
// that gradient and end-to-end checks need. The update is checked against the
// plain double re-implementation of optim_reference.h to 1e-12 — far below
// float32 rounding, so a float32 path anywhere in the update would fail.
#include <gtest/gtest.h>

#include "chorus/core/rng.h"
#include "chorus/models/models.h"
#include "chorus/nn/functional.h"
#include "chorus/ops/factory.h"
#include "chorus/optim/adamw.h"
#include "chorus/optim/sgd.h"
#include "optim_reference.h"

namespace chorus::optim {
namespace {

using testing::expect_close;
using testing::expect_throw_with;
using testing::random_vec;
using testing::RefAdamW;
using testing::RefSGD;
using testing::Vec;

Tensor param64(const Vec& v, const Shape& shape) {
  Tensor t = from_vector(v, shape, TensorOptions(kFloat64));
  t.set_requires_grad(true);
  return t;
}

Vec values64(const Tensor& t) { return t.contiguous().to_vector<double>(); }

// Six steps on a matrix, a vector and a transposed (dense, not contiguous)
// matrix; the gradients are full-precision doubles (not float-rounded).
template <typename Ref, typename MakeOpt>
void run_float64(Ref proto, MakeOpt make) {
  const std::vector<Shape> shapes = {{3, 5}, {7}, {4, 3}};
  std::vector<Tensor> params;
  std::vector<Vec> ref_p;
  std::vector<Ref> ref;
  for (size_t k = 0; k < shapes.size(); ++k) {
    Vec v = random_vec(numel_of(shapes[k]), 20 + k);
    for (double& e : v) e += 1e-9 * e;  // not representable in float32
    Tensor p = param64(v, shapes[k]);
    if (k == 2) p = p.t();
    params.push_back(p);
    ref_p.push_back(values64(p));
    ref.push_back(proto);
  }
  auto opt = make(params);
  for (int step = 0; step < 6; ++step) {
    opt->zero_grad();
    for (size_t k = 0; k < params.size(); ++k) {
      Vec g = random_vec(params[k].numel(), 200 * step + k);
      for (double& e : g) e = e / 3.0;  // full double precision
      params[k].set_grad(from_vector(g, params[k].sizes(), TensorOptions(kFloat64)));
      ref[k].step(ref_p[k], g);
    }
    opt->step();
    for (size_t k = 0; k < params.size(); ++k) {
      EXPECT_EQ(params[k].dtype(), kFloat64);
      expect_close(values64(params[k]), ref_p[k], 1e-12, "param " + std::to_string(k) + " step " + std::to_string(step));
    }
  }
  for (auto& [name, t] : opt->state())
    if (t.dim() > 0) EXPECT_EQ(t.dtype(), kFloat64) << name << ": state is kept in the parameter's dtype";
}

TEST(OptimFloat64, SGDMatchesDoubleReference) {
  run_float64(RefSGD{0.1, 0.9, 0, 5e-4, true, {}}, [](std::vector<Tensor> p) {
    return std::make_unique<SGD>(p, SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 5e-4, .nesterov = true});
  });
}

TEST(OptimFloat64, AdamWMatchesDoubleReference) {
  run_float64(RefAdamW{1e-2, 0.9, 0.999, 1e-8, 1e-2, {}, {}, 0}, [](std::vector<Tensor> p) {
    return std::make_unique<AdamW>(p, AdamWOptions{.lr = 1e-2, .weight_decay = 1e-2});
  });
}

// End to end: an MLP converted to float64 trains, and its weights follow the
// float32 run of the same initial weights and batches to float32 rounding
// (the double run is the reference the float one is judged by).
TEST(OptimFloat64, MLPTrainsInDoubleAndFloatFollows) {
  manual_seed(3);
  auto m64 = models::make_model("mlp", {{1, 28, 28}, 10});
  auto m32 = m64->clone(cpu_device(0));
  m64->to(kFloat64);
  SGD o64(m64->parameters(), {.lr = 0.05, .momentum = 0.9, .nesterov = true});
  SGD o32(m32->parameters(), {.lr = 0.05, .momentum = 0.9, .nesterov = true});
  double first = 0, last = 0;
  const Tensor x = randn({16, 1, 28, 28});
  const Tensor y = randint(0, 10, {16});  // one batch, fitted: the loss must fall
  for (int step = 0; step < 8; ++step) {
    Tensor l64 = nn::functional::cross_entropy(m64->forward(x.to(kFloat64)), y);
    Tensor l32 = nn::functional::cross_entropy(m32->forward(x), y);
    EXPECT_EQ(l64.dtype(), kFloat64);
    EXPECT_NEAR(l64.item(), l32.item(), 1e-4 * std::max(1.0, std::abs(l64.item())));
    if (step == 0) first = l64.item();
    last = l64.item();
    o64.zero_grad(); l64.backward(); o64.step();
    o32.zero_grad(); l32.backward(); o32.step();
  }
  EXPECT_LT(last, first);
  auto p64 = m64->named_parameters(), p32 = m32->named_parameters();
  ASSERT_EQ(p64.size(), p32.size());
  for (size_t i = 0; i < p64.size(); ++i) {
    EXPECT_EQ(p64[i].second.dtype(), kFloat64);
    Vec a = values64(p64[i].second), b = testing::values(p32[i].second);
    expect_close(b, a, 1e-4, p64[i].first);
  }
}

TEST(OptimFloat64, GpuRefusesFloat64Parameters_CUDA) {
  if (!cuda_is_available()) GTEST_SKIP() << "no CUDA device";
  Tensor p = from_vector(random_vec(4, 1), {4}, TensorOptions(kFloat64, cuda_device(0)));
  p.set_requires_grad(true);
  expect_throw_with<ValueError>([&] { SGD({p}, {.lr = 0.1}); }, "float64 parameters are supported on CPU devices only");
  expect_throw_with<ValueError>([&] { AdamW({p}, {.lr = 0.1}); }, "float64 parameters are supported on CPU devices only");
}

}  // namespace
}  // namespace chorus::optim
