// Note [Clipping in the update] (optim/clip_grad.h): clip_grad_norm_scale then
// Optimizer::step_scaled against clip_grad_norm_ then step() -- the same
// parameters to the bit -- and against a double re-implementation of
// torch's clip_grad_norm_ then AdamW; SGD's in-place fallback; a tiny GPT's
// training losses both ways (float64 and float32 on the CPU; on a GPU, inside
// a captured step).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include <chorus/chorus.h>
#include <chorus/optim/adamw.h>
#include <chorus/optim/clip_grad.h>
#include <chorus/optim/sgd.h>
#include <chorus/parallel/graphed_step.h>

#include "optim/optim_reference.h"

namespace chorus::optim {
namespace {

using testing::expect_close;
using testing::expect_throw_with;
using testing::random_vec;
using testing::RefAdamW;
using testing::Vec;

Vec values_of(const Tensor& t) { return t.to(cpu_device(0)).to(kFloat64).contiguous().to_vector<double>(); }

// A matrix, a vector, a transposed matrix (dense, not contiguous), a column
// slice (not dense: its update reads a scaled copy) and a vector with no
// gradient at step 2; two weight-decay groups.
const std::vector<Shape> kShapes = {{5, 7}, {13}, {4, 3}, {3, 8}, {6}};
const std::vector<double> kDecay = {0.1, 0.0, 0.1, 0.1, 0.0};

std::vector<Tensor> make_params(DType dt) {
  std::vector<Tensor> params;
  for (size_t k = 0; k < kShapes.size(); ++k) {
    Vec v = random_vec(numel_of(kShapes[k]), 40 + k);
    if (dt == kFloat64)
      for (double& e : v) e += 1e-9 * e;  // not representable in float32
    Tensor p = from_vector(v, kShapes[k], TensorOptions(dt));
    if (k == 2) p = p.t();
    if (k == 3) p = p.narrow(1, 2, 4);
    p.set_requires_grad(true);
    params.push_back(p);
  }
  return params;
}

bool has_grad_at(size_t k, int step) { return !(k == 4 && step == 2); }

// Five AdamW steps on two copies of the parameters, clipped to `max_norm`
// in place on one and in the update on the other; both against the double
// reference. `clipped` counts the steps whose norm was above max_norm.
void run_both_ways(DType dt, double max_norm, int* clipped) {
  SCOPED_TRACE(std::string(dtype_name(dt)) + " max_norm " + std::to_string(max_norm));
  std::vector<Tensor> a = make_params(dt), b = make_params(dt);
  AdamWOptions o{.lr = 0.02, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.0};
  o.param_weight_decay = kDecay;
  AdamW opt_a(a, o), opt_b(b, o);
  std::vector<Vec> ref_p;
  std::vector<RefAdamW> ref;
  for (size_t k = 0; k < a.size(); ++k) {
    ref_p.push_back(values_of(a[k]));
    ref.push_back(RefAdamW{o.lr, o.beta1, o.beta2, o.eps, kDecay[k], {}, {}});
  }
  const double tol = dt == kFloat64 ? 1e-12 : 5e-6;
  for (int step = 0; step < 5; ++step) {
    opt_a.zero_grad();
    opt_b.zero_grad();
    std::vector<Vec> gs(a.size());
    double sq = 0;
    for (size_t k = 0; k < a.size(); ++k) {
      if (!has_grad_at(k, step)) continue;
      gs[k] = random_vec(a[k].numel(), 500 + 10 * step + k);
      for (double& e : gs[k]) e = dt == kFloat64 ? e * (k + 1) / 3.0 : static_cast<float>(e * (k + 1) * 0.4);
      for (double e : gs[k]) sq += e * e;
      a[k].set_grad(from_vector(gs[k], a[k].sizes(), TensorOptions(dt)));
      b[k].set_grad(from_vector(gs[k], b[k].sizes(), TensorOptions(dt)));
    }
    Tensor norm_a = clip_grad_norm_(a, max_norm);
    opt_a.step();
    ClipScale c = clip_grad_norm_scale(b, max_norm);
    EXPECT_EQ(c.scale.defined(), max_norm > 0);
    opt_b.step_scaled(c.scale);
    // torch: clip_coef = max_norm / (norm + 1e-6), clamped to 1.
    const double norm = std::sqrt(sq);
    const double coef = max_norm > 0 ? std::min(1.0, max_norm / (norm + 1e-6)) : 1.0;
    if (max_norm > 0 && norm > max_norm) ++*clipped;
    EXPECT_NEAR(norm_a.item(), norm, tol * norm);
    EXPECT_EQ(norm_a.item(), c.norm.item());
    for (size_t k = 0; k < a.size(); ++k) {
      const std::string what = "param " + std::to_string(k) + " step " + std::to_string(step);
      EXPECT_EQ(values_of(a[k]), values_of(b[k])) << what;
      if (!has_grad_at(k, step)) continue;
      Vec g = gs[k];
      for (double& e : g) e *= coef;
      ref[k].step(ref_p[k], g);
      expect_close(values_of(b[k]), ref_p[k], tol, what + " against the reference");
      // In place: scaled; in the update: as they were.
      expect_close(values_of(a[k].grad()), g, tol, what + " in-place gradient");
      EXPECT_EQ(values_of(b[k].grad()), values_of(from_vector(gs[k], b[k].sizes(), TensorOptions(dt)))) << what;
    }
    EXPECT_EQ(opt_a.step_count(), opt_b.step_count());
  }
  // The moments too: the next steps would show any difference.
  auto sa = opt_a.state(), sb = opt_b.state();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) EXPECT_EQ(values_of(sa[i].second), values_of(sb[i].second)) << sa[i].first;
}

TEST(ClipInUpdate, AdamWEqualsClipThenStepAndTorchsFormulas) {
  for (DType dt : {kFloat64, kFloat32}) {
    int clipped = 0;
    run_both_ways(dt, 0.5, &clipped);  // every step's norm is above it
    EXPECT_EQ(clipped, 5);
    clipped = 0;
    run_both_ways(dt, 1e3, &clipped);  // below: the scale is 1
    EXPECT_EQ(clipped, 0);
    run_both_ways(dt, 0.0, &clipped);  // off: no scale, the plain step
  }
}

// Optimizers without a fused path scale the gradients in place first.
TEST(ClipInUpdate, SgdScalesTheGradientsInPlace) {
  std::vector<Tensor> a = make_params(kFloat64), b = make_params(kFloat64);
  SGDOptions o{0.05, 0.9, 0.0, 1e-3, true};
  SGD opt_a(a, o), opt_b(b, o);
  for (int step = 0; step < 4; ++step) {
    for (size_t k = 0; k < a.size(); ++k) {
      Vec g = random_vec(a[k].numel(), 900 + 10 * step + k);
      a[k].set_grad(from_vector(g, a[k].sizes(), TensorOptions(kFloat64)));
      b[k].set_grad(from_vector(g, b[k].sizes(), TensorOptions(kFloat64)));
    }
    clip_grad_norm_(a, 0.7);
    opt_a.step();
    Tensor norm = clip_and_step(opt_b, b, 0.7);
    EXPECT_GT(norm.item(), 0.7);
    for (size_t k = 0; k < a.size(); ++k) {
      EXPECT_EQ(values_of(a[k]), values_of(b[k])) << "param " << k << " step " << step;
      EXPECT_EQ(values_of(a[k].grad()), values_of(b[k].grad())) << "gradient " << k << " step " << step;
    }
  }
}

TEST(ClipInUpdate, RejectsAScaleOfAnotherShapeOrDtype) {
  std::vector<Tensor> p = make_params(kFloat32);
  for (auto& t : p) t.set_grad(zeros(t.sizes()));
  AdamW adam(p, {});
  expect_throw_with<ValueError>([&] { adam.step_scaled(full({2}, 0.5)); },
                                "AdamW: the gradient scale must be one float32 or float64 element, got ");
  expect_throw_with<ValueError>([&] { adam.step_scaled(full({}, 1.0, {kInt64})); },
                                "AdamW: the gradient scale must be one float32 or float64 element, got ");
  SGD sgd(p, SGDOptions{0.1});
  expect_throw_with<ValueError>([&] { sgd.step_scaled(full({3}, 0.5)); },
                                "SGD: the gradient scale must be one float32 or float64 element, got ");
  EXPECT_EQ(adam.step_count(), 0);
}

// ---- A GPT's training ----------------------------------------------------------

models::GPTConfig tiny_gpt() {
  models::GPTConfig c;
  c.layers = 2;
  c.heads = 2;
  c.width = 16;
  c.vocab = 23;
  c.padded_vocab = 32;
  c.context = 8;
  return c;
}

struct GptRun {
  std::vector<double> losses, norms;
  std::vector<Vec> params;
  int64_t replays = 0;
};

// `steps` steps of chorus train's GPT update (AdamW, matrices decayed,
// clipped to `clip`), the clip in place or in the update; on a GPU through
// parallel::GraphedStep (captured after its warm-up), as the trainer does.
GptRun train_gpt(Device dev, DType dt, bool in_update, double clip, int steps) {
  manual_seed(77);
  auto model = std::make_shared<models::GPT>(tiny_gpt());
  model->to(dt);
  model->to(dev);
  std::vector<Tensor> params;
  AdamWOptions o{.lr = 3e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
  for (auto& [name, p] : model->named_parameters()) {
    params.push_back(p);
    o.param_weight_decay.push_back(p.dim() >= 2 ? 0.1 : 0.0);
  }
  AdamW opt(params, o);
  parallel::GraphedStepOptions go;
  go.enabled = dev.is_cuda();
  go.on_fallback = [](const std::string& line) { ADD_FAILURE() << line; };
  parallel::GraphedStep step(
      [&](const std::vector<Tensor>& in) {
        Tensor loss = model->loss(in[0], in[1]);
        loss.backward();
        Tensor norm;
        if (in_update) {
          norm = clip_and_step(opt, params, clip);
        } else {
          norm = clip_grad_norm_(params, clip);
          opt.step();
        }
        opt.zero_grad();
        return std::vector<Tensor>{loss, norm};
      },
      go);
  GptRun run;
  // One batch over and over: the loss falls (memorised), so the steps are learning.
  manual_seed(1000);
  Tensor ids = randint(0, 23, {4, 8}, {kInt64}), tg = randint(0, 23, {4, 8}, {kInt64});
  for (int i = 0; i < steps; ++i) {
    opt.set_lr(3e-3 * (1.0 - 0.05 * i));
    auto out = step({ids.to(dev), tg.to(dev)});
    run.losses.push_back(out[0].to(cpu_device(0)).to(kFloat64).item());
    run.norms.push_back(out[1].to(cpu_device(0)).to(kFloat64).item());
  }
  for (const Tensor& p : params) run.params.push_back(values_of(p));
  run.replays = step.replays();
  return run;
}

TEST(ClipInUpdate, GptTrainingLossesEqualClipThenStep) {
  for (DType dt : {kFloat64, kFloat32}) {
    SCOPED_TRACE(dtype_name(dt));
    const GptRun a = train_gpt(cpu_device(0), dt, false, 0.4, 8);
    const GptRun b = train_gpt(cpu_device(0), dt, true, 0.4, 8);
    // Clipped on some steps at least (else the test shows nothing).
    EXPECT_GT(*std::max_element(a.norms.begin(), a.norms.end()), 0.4);
    EXPECT_EQ(a.losses, b.losses);
    EXPECT_EQ(a.norms, b.norms);
    ASSERT_EQ(a.params.size(), b.params.size());
    for (size_t i = 0; i < a.params.size(); ++i) EXPECT_EQ(a.params[i], b.params[i]) << "parameter " << i;
    EXPECT_LT(b.losses.back(), b.losses.front());
  }
}

// On a GPU the step is captured (the scale a device tensor the graph's AdamW
// reads each replay). The two ways run the same kernels but for the scale
// pass; the tolerance allows for kernels that add in a varying order.
TEST(ClipInUpdate, GptTrainingLossesEqualClipThenStepInACapturedStep_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const GptRun a = train_gpt(cuda_device(0), kFloat32, false, 0.4, 10);
  const GptRun b = train_gpt(cuda_device(0), kFloat32, true, 0.4, 10);
  EXPECT_EQ(b.replays, 8);  // two warm-up steps, then the graph
  EXPECT_GT(*std::max_element(b.norms.begin(), b.norms.end()), 0.4);
  for (size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_NEAR(a.losses[i], b.losses[i], 1e-5 * std::abs(a.losses[i])) << "step " << i;
    EXPECT_NEAR(a.norms[i], b.norms[i], 1e-5 * std::abs(a.norms[i])) << "step " << i;
  }
  for (size_t i = 0; i < a.params.size(); ++i) expect_close(b.params[i], a.params[i], 1e-5, "parameter " + std::to_string(i));
}

}  // namespace
}  // namespace chorus::optim
