// Memory-format propagation on CUDA: a network converted to channels-last
// (Module::to_channels_last, channels-last input) must stay NHWC through its
// backward pass too. The gradient entering the convolutional trunk comes from
// a global pool as an NCHW-contiguous [N,C,1,1] tensor; if the backward ops
// followed that gradient's layout, every later backward op would run NCHW on
// NHWC saved tensors (slow cuDNN paths, strided elementwise kernels). Checked
// on a Wide ResNet: the input gradient is channels-last and every gradient
// equals the NCHW network's, in float32 (TF32 off) and under bf16 autocast.
#ifdef CHORUS_WITH_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include <chorus/autograd/autocast.h>
#include <chorus/chorus.h>
#include <chorus/cuda/blas/blas.h>
#include <chorus/models/models.h>
#include <chorus/ops/copy.h>

#include "testing/compare.h"

namespace chorus {
namespace {

using test::rel_err;

struct StepResult {
  Tensor loss, x_grad;
  nn::NamedTensors grads;
};

StepResult train_step(bool channels_last, bool bf16) {
  manual_seed(21);
  nn::ModulePtr model = models::make_model("wrn-10-2", models::ModelSpec{{3, 16, 16}, 10});
  model->to(cuda_device(0));
  Tensor x = randn({6, 3, 16, 16}).to(cuda_device(0));
  Tensor target = randint(0, 10, {6}).to(cuda_device(0));
  if (channels_last) {
    model->to_channels_last();
    x = ops::to_channels_last(x);
  }
  x.set_requires_grad(true);
  Tensor loss;
  {
    std::optional<AutocastGuard> amp;
    if (bf16) amp.emplace(kBFloat16);
    loss = nn::functional::cross_entropy(model->forward(x), target);
  }
  loss.backward();
  StepResult r{loss, x.grad(), {}};
  for (const auto& [name, p] : model->named_parameters()) r.grads.push_back({name, p.grad()});
  return r;
}

void expect_channels_last_grad(const StepResult& r) {
  ASSERT_TRUE(r.x_grad.defined());
  EXPECT_TRUE(ops::is_channels_last(r.x_grad))
      << "input gradient of a channels-last network came back with strides "
      << shape_str(r.x_grad.strides());
}

TEST(CudaChannelsLast, BackwardStaysChannelsLastFloat32_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const bool tf32 = cuda::allow_tf32_conv();
  cuda::set_allow_tf32_conv(false);
  const StepResult nchw = train_step(false, false), nhwc = train_step(true, false);
  cuda::set_allow_tf32_conv(tf32);
  expect_channels_last_grad(nhwc);
  EXPECT_LE(rel_err(nhwc.loss, nchw.loss), 1e-4);
  EXPECT_LE(rel_err(nhwc.x_grad, nchw.x_grad), 1e-4);
  ASSERT_EQ(nhwc.grads.size(), nchw.grads.size());
  for (size_t i = 0; i < nchw.grads.size(); ++i)
    EXPECT_LE(rel_err(nhwc.grads[i].second, nchw.grads[i].second), 1e-4) << nchw.grads[i].first;
}

// bf16 rounds at every convolution and batch norm, and the two layouts round in
// different places (different kernels, different summation orders), so their
// gradients are compared with the float32 ones: channels-last bf16 must be
// about as accurate as NCHW bf16.
TEST(CudaChannelsLast, BackwardStaysChannelsLastBFloat16_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const bool tf32 = cuda::allow_tf32_conv();
  cuda::set_allow_tf32_conv(false);
  const StepResult ref = train_step(false, false);
  cuda::set_allow_tf32_conv(tf32);
  const StepResult nchw = train_step(false, true), nhwc = train_step(true, true);
  expect_channels_last_grad(nhwc);
  auto close = [](double err_cl, double err_nchw) { return err_cl <= 3 * err_nchw + 0.03; };
  EXPECT_PRED2(close, rel_err(nhwc.loss, ref.loss), rel_err(nchw.loss, ref.loss));
  EXPECT_PRED2(close, rel_err(nhwc.x_grad, ref.x_grad), rel_err(nchw.x_grad, ref.x_grad));
  ASSERT_EQ(nhwc.grads.size(), ref.grads.size());
  for (size_t i = 0; i < ref.grads.size(); ++i)
    EXPECT_PRED2(close, rel_err(nhwc.grads[i].second, ref.grads[i].second),
                 rel_err(nchw.grads[i].second, ref.grads[i].second))
        << ref.grads[i].first;
}

}  // namespace
}  // namespace chorus

#endif  // CHORUS_WITH_CUDA
