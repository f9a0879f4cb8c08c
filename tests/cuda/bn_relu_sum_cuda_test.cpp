// The GPU's batch norm over a sum (Note [Residual add left to the batch norm]
// in ops/nn.h): the channels-last kernel that adds a and b in the statistics
// pass writes the same bits as the add then the batch norm on the GPU (sum,
// output, saved and running statistics, counter) and matches the CPU; NCHW
// and odd channel counts take the add-then-batch-norm path. And a Wide ResNet
// on the GPU, chained unsummed, gives the same loss and gradients as its
// layers run one by one (each block summing its output) with the fused
// epilogue off, float32 and bfloat16.
#ifdef CHORUS_WITH_CUDA

#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <tuple>

#include <chorus/autograd/autocast.h>
#include <chorus/chorus.h>
#include <chorus/cuda/conv/conv_plan.h>
#include <chorus/models/models.h>
#include <chorus/ops/copy.h>
#include <chorus/ops/elementwise.h>
#include <chorus/ops/nn.h>

#include "testing/compare.h"
#include "testing/deterministic.h"
#include "testing/model_grads.h"

namespace chorus {
namespace {

namespace F = nn::functional;

Tensor bn_sum_on_gpu(const Tensor& t, DType dtype, bool cl) {
  Tensor g = t.to(dtype).to(cuda_device(0));
  return cl && g.dim() == 4 ? ops::to_channels_last(g) : g;
}

void check_bn_relu_sum(const Shape& xs, DType dtype, bool cl) {
  const std::string what = std::string(dtype_name(dtype)) + (cl ? " NHWC " : " NCHW ") + shape_str(xs);
  const int64_t c = xs[1];
  manual_seed(40 + c);
  // Values that round to dtype first, so the CPU sees the GPU's inputs.
  const Tensor a = randn(xs).mul(2.0).to(dtype).to(kFloat32), b = randn(xs).add(0.5).to(dtype).to(kFloat32);
  const Tensor w = rand({c}).add(0.5), bias = randn({c}), rm0 = randn({c}), rv0 = rand({c}).add(0.5);
  const Device gpu = cuda_device(0);
  auto fresh = [&](const Tensor& t) { return t.to(gpu).clone(); };
  const Tensor ga = bn_sum_on_gpu(a, dtype, cl), gb = bn_sum_on_gpu(b, dtype, cl);
  Tensor rm1 = fresh(rm0), rv1 = fresh(rv0), n1 = full({}, 7.0, {kInt64, gpu});
  Tensor rm2 = fresh(rm0), rv2 = fresh(rv0), n2 = full({}, 7.0, {kInt64, gpu});
  auto [s1, y1, m1, i1] = ops::batch_norm_relu_sum(ga, gb, w.to(gpu), bias.to(gpu), rm1, rv1, 0.1, 1e-3, n1);
  const Tensor s2 = ops::binary(BinaryOp::Add, ga, gb, 1.0);
  auto [y2, m2, i2] = ops::batch_norm_relu(s2, w.to(gpu), bias.to(gpu), rm2, rv2, 0.1, 1e-3, n2);
  EXPECT_EQ(test::rel_err(s1, s2), 0.0) << "sum " << what;
  EXPECT_EQ(test::rel_err(y1, y2), 0.0) << "y " << what;
  EXPECT_EQ(test::rel_err(m1, m2), 0.0) << "mean " << what;
  EXPECT_EQ(test::rel_err(i1, i2), 0.0) << "invstd " << what;
  EXPECT_EQ(test::rel_err(rm1, rm2), 0.0) << "running_mean " << what;
  EXPECT_EQ(test::rel_err(rv1, rv2), 0.0) << "running_var " << what;
  EXPECT_EQ(n1.to(cpu_device(0)).item<int64_t>(), 8) << what;
  EXPECT_EQ(ops::is_channels_last(s1), cl && xs.size() == 4) << what;
  // The CPU, in float32 from the same (rounded) inputs.
  Tensor crm = rm0.clone(), crv = rv0.clone();
  auto [cs, cy, cm, ci] = ops::batch_norm_relu_sum(a, b, w, bias, crm, crv, 0.1, 1e-3);
  const double tol = dtype == kFloat32 ? 1e-5 : 1e-2;
  EXPECT_LT(test::rel_err(s1, cs), tol) << "sum vs CPU " << what;
  EXPECT_LT(test::rel_err(y1, cy), dtype == kFloat32 ? 1e-4 : 2e-2) << "y vs CPU " << what;
  // (The CPU sums in float32; the GPU's variance is of the bfloat16-rounded sum.)
  EXPECT_LT(test::rel_err(rv1, crv), dtype == kFloat32 ? 1e-4 : 1e-2) << "running_var vs CPU " << what;
}

TEST(CudaBatchNormReluSum, OnePassMatchesAddThenBatchNorm_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  for (DType dtype : {kFloat32, kBFloat16}) {
    check_bn_relu_sum({16, 160, 8, 8}, dtype, true);  // WRN-28-10's first group's width, many row blocks
    check_bn_relu_sum({8, 640, 4, 4}, dtype, true);   // 80 threads a row
    check_bn_relu_sum({4, 3, 7, 5}, dtype, true);     // odd C: packs of one
    check_bn_relu_sum({6, 16, 5, 5}, dtype, false);   // NCHW: the add, then cuDNN
  }
}

// The loss and every parameter's gradient of `model` (a Wide ResNet) and of
// its layers run one by one, on one batch.
void expect_wrn_chain_matches_layers(DType dtype) {
  const Device gpu = cuda_device(0);
  manual_seed(21);
  nn::ModulePtr model = models::make_model("wrn-10-2", models::ModelSpec{{3, 16, 16}, 10});
  model->to(gpu);
  model->to_channels_last();
  auto layers = models::as_sequential(model);
  const Tensor x = ops::to_channels_last(randn({8, 3, 16, 16}).to(gpu));
  const Tensor target = randint(0, 10, {8}).to(gpu);
  auto grads = [&](const nn::ModulePtr& m) {
    return test::loss_and_grads(*model, [&] {
      std::optional<AutocastGuard> autocast;
      if (dtype != kFloat32) autocast.emplace(dtype);
      return F::cross_entropy(m->forward(x), target);
    });
  };
  const std::vector<Tensor> chained = grads(model), one_by_one = grads(layers);
  ASSERT_EQ(chained.size(), one_by_one.size());
  for (size_t i = 0; i < chained.size(); ++i)
    EXPECT_EQ(test::rel_err(chained[i], one_by_one[i]), 0.0) << dtype_name(dtype) << " tensor " << i;
}

TEST(CudaBatchNormReluSum, WideResNetChainMatchesItsLayers_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  // Without the fused epilogue every block leaves its add to the next batch
  // norm, and both runs add the same two rounded tensors.
  cuda::set_conv_add_epilogue(false);
  struct Restore {
    ~Restore() { cuda::set_conv_add_epilogue(true); }
  } restore;
  const bool heuristic = cuda::heuristic_plans();
  cuda::set_heuristic_plans(true);  // the same convolution plans in both runs
  struct RestorePlans {
    bool on;
    ~RestorePlans() { cuda::set_heuristic_plans(on); }
  } restore_plans{heuristic};
  test::DeterministicConvolutions deterministic;  // no atomics in the weight gradients
  for (DType dtype : {kFloat32, kBFloat16}) expect_wrn_chain_matches_layers(dtype);
}

}  // namespace
}  // namespace chorus

#endif  // CHORUS_WITH_CUDA
