// The batch norm that adds its input's two addends itself (Note [Residual add
// left to the batch norm] in ops/nn.h) on the CPU: the same bits as add()
// then batch_norm_relu, forward, running statistics and every gradient; Wide
// ResNet's unsummed chain of blocks against its layers run one by one
// (as_sequential, which sums each block's output); and the errors. The GPU's
// one-pass kernel is checked against these in
// tests/cuda/bn_relu_sum_cuda_test.cpp.
#include <gtest/gtest.h>

#include <chorus/chorus.h>
#include <chorus/models/models.h>
#include <chorus/ops/nn.h>

#include "testing/compare.h"
#include "testing/expect_error.h"
#include "testing/model_grads.h"

namespace chorus {
namespace {

namespace F = nn::functional;

struct BnSumRun {
  Tensor s, y, rm, rv, count, da, db, dw, dbias;
};

BnSumRun run_bn_relu_sum(bool fused, const Tensor& a0, const Tensor& b0, const Tensor& w0, const Tensor& bias0) {
  Tensor a = a0.detach(), b = b0.detach(), w = w0.detach(), bias = bias0.detach();
  for (Tensor* t : {&a, &b, &w, &bias}) t->set_requires_grad(true);
  Tensor rm = zeros({a.size(1)}), rv = ones({a.size(1)}), count = zeros({}, kInt64);
  Tensor s, y;
  if (fused) {
    std::tie(s, y) = F::batch_norm_relu_sum(a, b, rm, rv, w, bias, true, 0.1, 1e-5, count);
  } else {
    s = add(a, b);
    y = F::batch_norm_relu(s, rm, rv, w, bias, true, 0.1, 1e-5, count);
  }
  // Both outputs in the loss, each element weighed differently.
  const Tensor ry = randn(y.sizes()), rs = randn(s.sizes());
  add(y.mul(ry).sum(), s.mul(rs).sum()).backward();
  return {s.detach(), y.detach(), rm, rv, count, a.grad(), b.grad(), w.grad(), bias.grad()};
}

TEST(BatchNormReluSum, SameBitsAsAddThenBatchNormRelu) {
  manual_seed(3);
  const Tensor a = randn({4, 6, 5, 3}), b = randn({4, 6, 5, 3}), w = rand({6}).add(0.5), bias = randn({6});
  manual_seed(4);
  const BnSumRun f = run_bn_relu_sum(true, a, b, w, bias);
  manual_seed(4);
  const BnSumRun r = run_bn_relu_sum(false, a, b, w, bias);
  EXPECT_EQ(test::rel_err(f.s, r.s), 0.0);
  EXPECT_EQ(test::rel_err(f.y, r.y), 0.0);
  EXPECT_EQ(test::rel_err(f.rm, r.rm), 0.0);
  EXPECT_EQ(test::rel_err(f.rv, r.rv), 0.0);
  EXPECT_EQ(f.count.item<int64_t>(), 1);
  EXPECT_EQ(r.count.item<int64_t>(), 1);
  EXPECT_EQ(test::rel_err(f.da, r.da), 0.0);
  EXPECT_EQ(test::rel_err(f.db, r.db), 0.0);
  EXPECT_EQ(test::rel_err(f.dw, r.dw), 0.0);
  EXPECT_EQ(test::rel_err(f.dbias, r.dbias), 0.0);
}

TEST(BatchNormReluSum, NoAddendOrEvaluationIsThePlainBatchNorm) {
  manual_seed(6);
  const Tensor a = randn({3, 4, 2, 2}), b = randn({3, 4, 2, 2});
  Tensor rm = randn({4}), rv = rand({4}).add(0.5);
  auto [s, y] = F::batch_norm_relu_sum(a, Tensor(), rm, rv, Tensor(), Tensor(), true);
  EXPECT_TRUE(s.is_same(a));
  EXPECT_EQ(test::rel_err(y, F::batch_norm_relu(a, rm.clone(), rv.clone(), Tensor(), Tensor(), true)), 0.0);
  auto [se, ye] = F::batch_norm_relu_sum(a, b, rm, rv, Tensor(), Tensor(), false);
  EXPECT_EQ(test::rel_err(se, add(a, b)), 0.0);
  EXPECT_EQ(test::rel_err(ye, F::batch_norm_relu(add(a, b), rm, rv, Tensor(), Tensor(), false)), 0.0);
}

TEST(BatchNormReluSum, OpsNameMismatchedAddends) {
  const Tensor a = randn({2, 3, 4, 4});
  EXPECT_TRUE(test::throws_naming([&] { ops::batch_norm_relu_sum(a, randn({2, 3, 4, 5}), Tensor(), Tensor(), Tensor(), Tensor(), 0.1, 1e-5); },
                                  {"batch_norm_relu_sum", "[2, 3, 4, 5]", "must share shape"}));
  EXPECT_TRUE(test::throws_naming([&] { ops::batch_norm_relu_sum(a, a.to(kFloat64), Tensor(), Tensor(), Tensor(), Tensor(), 0.1, 1e-5); },
                                  {"batch_norm_relu_sum", "must share shape, dtype and device"}));
}

// WideResNet::forward chains its blocks unsummed; as_sequential runs the same
// modules one by one, each block summing its own output (conv2d_add). On the
// CPU both add in float32 once: the same bits, loss and every gradient.
TEST(BatchNormReluSum, WideResNetChainMatchesItsLayers) {
  manual_seed(12);
  nn::ModulePtr model = models::make_model("wrn-10-2", models::ModelSpec{{3, 8, 8}, 5});
  auto layers = models::as_sequential(model);
  const Tensor x = randn({4, 3, 8, 8});
  const Tensor target = randint(0, 5, {4});
  auto grads = [&](const nn::ModulePtr& m) {
    return test::loss_and_grads(*model, [&] { return F::cross_entropy(m->forward(x), target); });
  };
  const std::vector<Tensor> chained = grads(model), one_by_one = grads(layers);
  ASSERT_EQ(chained.size(), one_by_one.size());
  for (size_t i = 0; i < chained.size(); ++i) EXPECT_EQ(test::rel_err(chained[i], one_by_one[i]), 0.0) << i;
}

}  // namespace
}  // namespace chorus
