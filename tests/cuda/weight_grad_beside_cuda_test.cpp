// Note [Weight gradients beside the data gradient] (autograd/side_work.h) and
// Note [Float filter gradients from 16-bit data] (cuda/conv/conv.cpp): a
// convolution's weight gradient computed on a side stream, and asked for in
// float32 from 16-bit data under autocast. Checked against the same backward
// on one stream (bit for bit, deterministic convolutions), through the cases
// that read the gradient early (a weight used twice, a .grad accumulated into,
// a hook), and the float gradient against the CPU in double.
#ifdef CHORUS_WITH_CUDA

#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <string>
#include <vector>

#include <chorus/autograd/autocast.h>
#include <chorus/autograd/node.h>
#include <chorus/autograd/side_work.h>
#include <chorus/cuda/conv/conv_direct.h>
#include <chorus/chorus.h>
#include <chorus/models/models.h>
#include <chorus/ops/copy.h>
#include <chorus/ops/nn.h>

#include "testing/deterministic.h"
#include "testing/model_grads.h"

namespace chorus {
namespace {

std::vector<double> beside_doubles(const Tensor& t) {
  return t.to(cpu_device(0)).to(kFloat64).contiguous().to_vector<double>();
}
std::vector<float> beside_floats(const Tensor& t) {
  return t.to(cpu_device(0)).to(kFloat32).contiguous().to_vector<float>();
}

// Side work on or off for a scope.
class BesideSwitch {
 public:
  explicit BesideSwitch(bool on) { autograd::set_beside_enabled(on); }
  ~BesideSwitch() { autograd::set_beside_enabled(true); }
};

// The direct convolution kernels off for a scope.
class DirectKernelsOff {
 public:
  DirectKernelsOff() : prev_(cuda::conv_direct_enabled()) { cuda::set_conv_direct_enabled(false); }
  ~DirectKernelsOff() { cuda::set_conv_direct_enabled(prev_); }

 private:
  bool prev_;
};

struct FdwCase {
  int64_t n, c, h, w, k, r, stride, pad;
  DType dt;
  bool channels_last;
};

TEST(FloatFilterGrad, IsTheSixteenBitGradientConverted_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  test::DeterministicConvolutions det;
  const std::vector<FdwCase> cases{
      {8, 32, 16, 16, 48, 3, 1, 1, kBFloat16, true},   // a Wide ResNet 3x3
      {8, 64, 16, 16, 32, 1, 2, 0, kBFloat16, true},   // a strided 1x1 shortcut
      {8, 3, 16, 16, 16, 3, 1, 1, kBFloat16, true},    // the stem: 3 channels
      {4, 16, 12, 12, 24, 3, 2, 1, kFloat16, true},
      {4, 16, 12, 12, 24, 3, 1, 1, kBFloat16, false},  // NCHW
  };
  manual_seed(71);
  for (const FdwCase& c : cases) {
    SCOPED_TRACE("c" + std::to_string(c.c) + " k" + std::to_string(c.k) + " r" + std::to_string(c.r) + " s" +
                 std::to_string(c.stride) + (c.dt == kFloat16 ? " fp16" : " bf16") + (c.channels_last ? " NHWC" : " NCHW"));
    const ops::Conv2dParams p{c.stride, c.stride, c.pad, c.pad};
    auto on_gpu = [&](const Tensor& t) {
      Tensor g = t.to(c.dt).to(cuda_device(0));
      return c.channels_last ? ops::to_channels_last(g) : g;
    };
    const Tensor x = on_gpu(randn({c.n, c.c, c.h, c.w}));
    const Tensor w = on_gpu(randn({c.k, c.c, c.r, c.r}));
    const int64_t oh = (c.h + 2 * c.pad - c.r) / c.stride + 1;
    const Tensor dy = on_gpu(randn({c.n, c.k, oh, oh}));
    {
      // The stem's direct kernels (cuda/conv/conv_direct.h) write a float gradient
      // themselves, unrounded, where their timing beats cuDNN's (it did under
      // compute-sanitizer, whose instrumentation slows cuDNN's kernels more):
      // the conversion is checked with them off, the float gradient of
      // whichever path wins against the CPU below.
      DirectKernelsOff off;
      const Tensor dw32 = ops::conv2d_backward_weight(dy, x, w, p, false, kFloat32).first;
      const Tensor dw16 = ops::conv2d_backward_weight(dy, x, w, p, false).first;
      ASSERT_EQ(dw32.dtype(), kFloat32);
      ASSERT_EQ(dw16.dtype(), c.dt);
      EXPECT_EQ(beside_floats(dw32), beside_floats(dw16)) << "the float gradient is the 16-bit one converted";
    }
    const Tensor dw32 = ops::conv2d_backward_weight(dy, x, w, p, false, kFloat32).first;
    ASSERT_EQ(dw32.dtype(), kFloat32);
    // The same 16-bit values summed in double on the CPU: within one 16-bit
    // rounding of the float sum.
    const Tensor xd = x.to(cpu_device(0)).to(kFloat64).contiguous(), dyd = dy.to(cpu_device(0)).to(kFloat64).contiguous();
    const Tensor wd = w.to(cpu_device(0)).to(kFloat64).contiguous();
    const std::vector<double> ref = beside_doubles(ops::conv2d_backward_weight(dyd, xd, wd, p, false).first);
    const std::vector<double> got = beside_doubles(dw32);
    ASSERT_EQ(got.size(), ref.size());
    double scale = 0;
    for (double v : ref) scale = std::max(scale, std::abs(v));
    const double rounding = c.dt == kBFloat16 ? 1.0 / 256 : 1.0 / 2048;
    for (size_t i = 0; i < ref.size(); ++i)
      ASSERT_NEAR(got[i], ref[i], rounding * std::abs(ref[i]) + 1e-4 * scale) << "element " << i;
  }
  // A float32 filter gradient is asked of 16-bit data only.
  const Tensor x = randn({2, 4, 6, 6}).to(cuda_device(0));
  EXPECT_THROW(ops::conv2d_backward_weight(randn({2, 4, 6, 6}).to(cuda_device(0)), x,
                                           randn({4, 4, 3, 3}).to(cuda_device(0)), {1, 1, 1, 1}, false, kBFloat16),
               Error);
}

// The leaves whose AccumulateGrad node is an input of a node named `name`.
std::set<const TensorImpl*> beside_leaves_fed_by(const Tensor& root, const std::string& name) {
  std::vector<autograd::Node*> stack{root.grad_fn().get()};
  std::set<autograd::Node*> seen(stack.begin(), stack.end());
  std::set<const TensorImpl*> leaves;
  while (!stack.empty()) {
    autograd::Node* node = stack.back();
    stack.pop_back();
    for (const autograd::Edge& e : node->next) {
      if (!e.fn) continue;
      if (node->name() == name && e.fn->is_accumulate_grad()) leaves.insert(e.fn->accumulated_leaf());
      if (seen.insert(e.fn.get()).second) stack.push_back(e.fn.get());
    }
  }
  return leaves;
}

nn::ModulePtr beside_wrn(bool channels_last) {
  manual_seed(72);
  nn::ModulePtr m = models::make_model("wrn-10-2", models::ModelSpec{{3, 16, 16}, 10});
  m->to(cuda_device(0));
  if (channels_last) m->to_channels_last();
  return m;
}

TEST(FloatFilterGrad, AutocastConvolutionsRecordTheirFloatWeights_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  nn::ModulePtr m = beside_wrn(true);
  const Tensor x = ops::to_channels_last(randn({8, 3, 16, 16}).to(cuda_device(0)));
  const Tensor y = randint(0, 10, {8}).to(cuda_device(0));
  Tensor loss;
  {
    AutocastGuard amp(kBFloat16);
    loss = nn::functional::cross_entropy(m->forward(x), y);
  }
  // Every convolution weight feeds its convolution's node directly; no
  // recorded cast reaches one.
  std::set<const TensorImpl*> conv_weights;
  for (const Tensor& p : m->parameters())
    if (p.dim() == 4) conv_weights.insert(p.impl());
  ASSERT_GT(conv_weights.size(), 5u);
  std::set<const TensorImpl*> direct = beside_leaves_fed_by(loss, "Conv2dBackward");
  for (const TensorImpl* l : beside_leaves_fed_by(loss, "Conv2dAddBackward")) direct.insert(l);
  EXPECT_EQ(direct, conv_weights);
  for (const TensorImpl* l : beside_leaves_fed_by(loss, "ToDtypeBackward"))
    EXPECT_EQ(conv_weights.count(l), 0u) << "a convolution weight is still cast by a recorded node";
  loss.backward();
  for (const Tensor& p : m->parameters()) {
    ASSERT_TRUE(p.grad().defined());
    EXPECT_EQ(p.grad().dtype(), kFloat32);
  }
}

// Note [Float weight gradients from 16-bit products]: under autocast a
// float32 linear layer's (with and without a bias) and GPT MLP's parameters feed their ops' nodes
// directly (no recorded cast), their gradients come out in float32, and they
// equal the gradients of the same ops run on bfloat16 copies of the
// parameters, up to those copies' 16-bit rounding of the gradient.
TEST(FloatWeightGrad, AutocastLinearsAndMlpsRecordTheirFloatParameters_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const Device gpu("cuda:0");
  manual_seed(74);
  const int64_t c = 64;
  auto param = [&](Shape s, double scale) { return randn(s).mul(scale).to(gpu).detach().requires_grad_(); };
  const Tensor w = param({3 * c, c}, 0.1), b = param({3 * c}, 0.1), w1 = param({4 * c, 3 * c}, 0.1),
               b1 = param({4 * c}, 0.1), w2 = param({c, 4 * c}, 0.05), b2 = param({c}, 0.1), w3 = param({96, c}, 0.1);
  const Tensor x = randn({4, 33, c}).to(gpu), gy = randn({4, 33, 96}).to(gpu);
  const std::vector<Tensor> params{w, b, w1, b1, w2, b2, w3};
  Tensor y;
  {
    AutocastGuard amp(kBFloat16);
    y = nn::functional::linear(nn::functional::mlp_gelu(nn::functional::linear(x, w, b), w1, b1, w2, b2), w3,
                               Tensor());
  }
  std::set<const TensorImpl*> direct = beside_leaves_fed_by(y, "LinearBackward");
  for (const TensorImpl* l : beside_leaves_fed_by(y, "MlpGeluBackward")) direct.insert(l);
  std::set<const TensorImpl*> want;
  for (const Tensor& p : params) want.insert(p.impl());
  EXPECT_EQ(direct, want);
  EXPECT_TRUE(beside_leaves_fed_by(y, "ToDtypeBackward").empty()) << "a parameter is still cast by a recorded node";
  y.backward(gy.to(kBFloat16));
  // The same ops on bfloat16 leaves: gradients in bfloat16.
  std::vector<Tensor> half;
  for (const Tensor& p : params) half.push_back(p.detach().to(kBFloat16).requires_grad_());
  Tensor yh = nn::functional::linear(
      nn::functional::mlp_gelu(nn::functional::linear(x.to(kBFloat16), half[0], half[1]), half[2], half[3], half[4],
                               half[5]),
      half[6], Tensor());
  yh.backward(gy.to(kBFloat16));
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_TRUE(params[i].grad().defined()) << "parameter " << i;
    EXPECT_EQ(params[i].grad().dtype(), kFloat32) << "parameter " << i;
    const std::vector<float> got = beside_floats(params[i].grad()), ref = beside_floats(half[i].grad());
    float scale = 0;
    for (float r : ref) scale = std::max(scale, std::abs(r));
    for (size_t j = 0; j < ref.size(); ++j)
      ASSERT_NEAR(got[j], ref[j], 8e-3 * std::abs(ref[j]) + 1e-3 * scale) << "parameter " << i << " element " << j;
  }
}

void expect_same_bits(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(beside_floats(a[i]), beside_floats(b[i])) << "tensor " << i;
}

TEST(WeightGradBeside, SameGradientsAsOneStream_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  test::DeterministicConvolutions det;
  for (bool bf16 : {true, false}) {
    SCOPED_TRACE(bf16 ? "bf16 autocast, channels-last" : "float32, NCHW");
    nn::ModulePtr m = beside_wrn(bf16);
    manual_seed(73);
    Tensor x = randn({8, 3, 16, 16}).to(cuda_device(0));
    if (bf16) x = ops::to_channels_last(x);
    const Tensor y = randint(0, 10, {8}).to(cuda_device(0));
    auto loss_fn = [&] {
      AutocastGuard amp(bf16 ? std::optional<DType>(kBFloat16) : std::nullopt);
      return nn::functional::cross_entropy(m->forward(x), y);
    };
    const int64_t before = autograd::beside_runs();
    const std::vector<Tensor> beside = test::loss_and_grads(*m, loss_fn);
    EXPECT_GT(autograd::beside_runs(), before) << "no weight gradient ran beside";
    std::vector<Tensor> one_stream;
    {
      BesideSwitch off(false);
      const int64_t off_before = autograd::beside_runs();
      one_stream = test::loss_and_grads(*m, loss_fn);
      EXPECT_EQ(autograd::beside_runs(), off_before);
    }
    expect_same_bits(beside, one_stream);
  }
}

// A weight used by two convolutions (its gradients summed by the engine), a
// .grad accumulated into by a second backward, and a hook that reads the
// gradient: each reads what ran beside, so each must wait for it.
TEST(WeightGradBeside, EarlyReadersWaitForIt_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  test::DeterministicConvolutions det;
  manual_seed(74);
  const Tensor x = randn({16, 32, 24, 24}).to(cuda_device(0));
  struct Result {
    std::vector<float> w, w2, seen_by_hook;
  };
  auto run = [&](bool on) {
    BesideSwitch sw(on);
    manual_seed(75);
    Tensor w = (randn({32, 32, 3, 3}) * 0.1).to(cuda_device(0));
    w.set_requires_grad(true);
    Tensor w2 = (randn({32, 32, 3, 3}) * 0.1).to(cuda_device(0));
    w2.set_requires_grad(true);
    Result r;
    w2.register_post_accumulate_hook([&r](Tensor& p) { r.seen_by_hook = beside_floats(p.grad()); });
    const nn::functional::Conv2dParams p{1, 1, 1, 1};
    for (int pass = 0; pass < 2; ++pass) {  // the second pass adds into .grad
      Tensor h = nn::functional::conv2d(x, w, Tensor(), p);
      h = nn::functional::conv2d(chorus::relu(h), w, Tensor(), p);  // w again
      h = nn::functional::conv2d(chorus::relu(h), w2, Tensor(), p);
      chorus::sum(h * h).backward();
    }
    r.w = beside_floats(w.grad());
    r.w2 = beside_floats(w2.grad());
    return r;
  };
  const Result on = run(true), off = run(false);
  EXPECT_EQ(on.w, off.w);
  EXPECT_EQ(on.w2, off.w2);
  EXPECT_EQ(on.seen_by_hook, off.seen_by_hook);
  EXPECT_EQ(on.seen_by_hook, on.w2);
}

}  // namespace
}  // namespace chorus

#endif  // CHORUS_WITH_CUDA
