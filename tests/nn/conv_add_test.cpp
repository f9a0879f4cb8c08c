// functional::conv2d_add (a residual block's last convolution with its
// shortcut added, Note [Residual add in the epilogue] in cuda/conv/conv.cpp) on the
// CPU: the same bits as conv2d followed by add, forward and every gradient,
// and one clear error per bad residual. The GPU's fused kernel is checked
// against this in tests/cuda/conv_add_cuda_test.cpp.
#include <gtest/gtest.h>

#include <chorus/chorus.h>
#include <chorus/models/models.h>

#include "chorus/cpu/kernels.h"

#include "testing/compare.h"
#include "testing/expect_error.h"

namespace chorus {
namespace {

namespace F = nn::functional;

struct ConvAddGrads {
  Tensor y, dx, dw, dr;
};

ConvAddGrads run_conv_add(bool fused, const Tensor& x0, const Tensor& w0, const Tensor& r0, const F::Conv2dParams& p) {
  Tensor x = x0.detach(), w = w0.detach(), r = r0.detach();
  x.set_requires_grad(true);
  w.set_requires_grad(true);
  r.set_requires_grad(true);
  Tensor y = fused ? F::conv2d_add(x, w, Tensor(), r, p) : add(F::conv2d(x, w, Tensor(), p), r);
  // A loss that weighs every output differently, so each gradient entry counts.
  Tensor weights = arange(0.0, static_cast<double>(y.numel()), 1.0, TensorOptions{y.dtype()}).reshape(y.sizes()).mul(0.01);
  y.mul(weights).sum().backward();
  return {y.detach(), x.grad(), w.grad(), r.grad()};
}

TEST(ConvAddCpu, SameBitsAsConvThenAdd) {
  manual_seed(5);
  const F::Conv2dParams p{2, 1, 1, 1, 1, 1, 1};
  const Tensor x = randn({3, 4, 7, 6}), w = randn({5, 4, 3, 3}), r = randn({3, 5, 4, 6});
  const ConvAddGrads a = run_conv_add(true, x, w, r, p), b = run_conv_add(false, x, w, r, p);
  EXPECT_EQ(test::rel_err(a.y, b.y), 0.0);
  EXPECT_EQ(test::rel_err(a.dx, b.dx), 0.0);
  EXPECT_EQ(test::rel_err(a.dw, b.dw), 0.0);
  EXPECT_EQ(test::rel_err(a.dr, b.dr), 0.0);
}

TEST(ConvAddCpu, WideResNetBlockTrainsAsBefore) {
  // WRN's blocks now end in conv2d_add; the block's output and gradients are
  // checked against the same weights run through conv2d + add by hand, for an
  // identity shortcut and a projection (1x1 convolution, stride 2).
  for (const models::PreActBlockOptions o : {models::PreActBlockOptions{4, 4, 1}, models::PreActBlockOptions{4, 6, 2}}) {
    manual_seed(9);
    auto block = std::make_shared<models::PreActBlock>(o);
    auto twin = std::make_shared<models::PreActBlock>(o);
    twin->load_state_dict(block->state_dict());
    const Tensor input = randn({2, 4, 6, 6});
    Tensor x = input.detach();
    x.set_requires_grad(true);
    Tensor y = block->forward(x);
    y.mul(y).sum().backward();

    const auto kids = twin->named_children();
    auto bn1 = std::static_pointer_cast<nn::BatchNorm2d>(kids[0].second);
    auto bn2 = std::static_pointer_cast<nn::BatchNorm2d>(kids[2].second);
    Tensor x2 = input.detach();
    x2.set_requires_grad(true);
    Tensor a = bn1->forward_relu(x2);
    Tensor h = kids[1].second->forward(a);
    Tensor shortcut = kids.size() > 4 ? kids[4].second->forward(a) : x2;
    Tensor y2 = add(kids[3].second->forward(bn2->forward_relu(h)), shortcut);
    y2.mul(y2).sum().backward();

    EXPECT_EQ(test::rel_err(y.detach(), y2.detach()), 0.0);
    EXPECT_EQ(test::rel_err(x.grad(), x2.grad()), 0.0);
    const auto p1 = block->named_parameters(), p2 = twin->named_parameters();
    ASSERT_EQ(p1.size(), p2.size());
    for (size_t i = 0; i < p1.size(); ++i)
      EXPECT_EQ(test::rel_err(p1[i].second.grad(), p2[i].second.grad()), 0.0) << p1[i].first;
  }
}

TEST(ConvAddCpu, BadResidualsNameWhatIsWrong) {
  const Tensor x = randn({2, 3, 5, 5}), w = randn({4, 3, 3, 3});
  const F::Conv2dParams p{1, 1, 1, 1, 1, 1, 1};
  EXPECT_TRUE(test::throws_naming([&] { F::conv2d_add(x, w, Tensor(), randn({2, 4, 5, 4}), p); },
                                  {"conv2d_add: residual", "[2, 4, 5, 4]", "must have the output's shape [2, 4, 5, 5]"}));
  EXPECT_TRUE(test::throws_naming([&] { F::conv2d_add(x, w, Tensor(), Tensor(), p); }, {"conv2d_add", "residual"}));
}

TEST(ConvAddCpu, KernelRefusesAResidualInTheOutput) {
  // The convolution writes y before the add reads the residual: one buffer
  // for both would add the convolution to itself.
  const Tensor x = randn({1, 2, 4, 4}), w = randn({2, 2, 3, 3});
  const Conv2dGeometry g{1, 2, 4, 4, 2, 3, 3, 1, 1, 1, 1};
  Tensor y = randn({1, 2, 4, 4});
  EXPECT_TRUE(test::throws_naming([&] { cpu::conv2d_forward_add(g, x, w, y, y); },
                                  {"conv2d_forward_add: residual", "overlaps the output"}));
}

}  // namespace
}  // namespace chorus
