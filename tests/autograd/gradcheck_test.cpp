// Every differentiable op checked against central finite differences in double
// (testing/gradcheck.h): elementwise ops with broadcasting, non-contiguous
// operands, reductions, matmul, joins and splits, indexing, softmax, views,
// dtype/device moves, and the nn functional ops.
#include <gtest/gtest.h>

#include <chorus/autograd/node.h>
#include <chorus/ops/elementwise.h>
#include <chorus/chorus.h>

#include "testing/expect_error.h"
#include "testing/gradcheck.h"

namespace chorus {
namespace {

using nn::functional::Conv2dParams;
using nn::functional::Pool2dParams;
using test::away_from_zero_leaf;
using test::distinct_leaf;
using test::gradcheck;
using test::leaf;
using test::random_leaf;
using test::random_leaf_in;
using L = const TensorList&;

Tensor idx(const std::vector<int64_t>& v, const Shape& s) { return from_vector(v, s, {kInt64}); }

// ---- the checker itself ------------------------------------------------------------

// A deliberately wrong backward (2x instead of 3x) must be caught, and the
// message must name the worst element.
TEST(GradcheckSelfTest, CatchesAWrongGradient) {
  Tensor x = random_leaf({2, 3}, 1);
  auto wrong = [](L in) {
    Tensor y = in[0].detach().mul(3.0);
    return autograd::record("WrongBackward", y, {in[0]}, [](const TensorList& g) { return TensorList{g[0].mul(2.0)}; });
  };
  ::testing::AssertionResult r = gradcheck(wrong, {x});
  EXPECT_FALSE(r);
  EXPECT_NE(std::string(r.message()).find("worst: input 0"), std::string::npos) << r.message();
  EXPECT_TRUE(gradcheck([](L in) { return in[0].mul(3.0); }, {x}));
}

TEST(GradcheckSelfTest, ThrowsNamingChecksTypeAndMessage) {
  auto bad = [] { CHORUS_THROW(ValueError, "myop: shape [2, 3]"); };
  EXPECT_TRUE(test::throws_naming(bad, {"myop", "[2, 3]"}));
  EXPECT_FALSE(test::throws_naming(bad, {"myop", "[3, 2]"}));
  EXPECT_FALSE(test::throws_naming<DeviceError>(bad, {"myop"}));
  EXPECT_FALSE(test::throws_naming([] {}, {}));
}

// ---- elementwise, with broadcasting ----------------------------------------------------

TEST(GradcheckElementwise, AddBroadcast) {
  Tensor a = random_leaf({3, 1, 4}, 10), b = random_leaf({5, 4}, 11);
  EXPECT_TRUE(gradcheck([](L x) { return add(x[0], x[1]); }, {a, b}));
  EXPECT_TRUE(gradcheck([](L x) { return add(x[0], x[1], -2.5); }, {a, b}));
  EXPECT_TRUE(gradcheck([](L x) { return x[1] + x[0]; }, {a, b}));
}

TEST(GradcheckElementwise, ScalarTensorOperands) {
  Tensor s = leaf({0.7}, {}), m = random_leaf({3, 4}, 12);
  EXPECT_TRUE(gradcheck([](L x) { return add(x[0], x[1]); }, {s, m}));
  EXPECT_TRUE(gradcheck([](L x) { return mul(x[1], x[0]); }, {s, m}));
  EXPECT_TRUE(gradcheck([](L x) { return div(x[1], x[0]); }, {s, m}));
  EXPECT_TRUE(gradcheck([](L x) { return sub(x[0], x[1]); }, {s, m}));
}

TEST(GradcheckElementwise, SubMulDivBroadcast) {
  Tensor a = random_leaf({3, 1, 4}, 13), b = random_leaf({5, 4}, 14);
  Tensor pos = random_leaf_in({5, 4}, 15, 0.5, 2.0);
  EXPECT_TRUE(gradcheck([](L x) { return sub(x[0], x[1]); }, {a, b}));
  EXPECT_TRUE(gradcheck([](L x) { return mul(x[0], x[1]); }, {a, b}));
  EXPECT_TRUE(gradcheck([](L x) { return div(x[0], x[1]); }, {a, pos}));
  EXPECT_TRUE(gradcheck([](L x) { return div(x[1], x[0]); }, {away_from_zero_leaf({3, 1, 4}, 16, 0.5), pos}));
}

TEST(GradcheckElementwise, MaximumBroadcast) {
  // Independent random values: a tie within the step has probability ~1e-5.
  Tensor a = random_leaf({3, 1, 4}, 17), b = random_leaf({5, 4}, 18);
  EXPECT_TRUE(gradcheck([](L x) { return maximum(x[0], x[1]); }, {a, b}));
}

TEST(GradcheckElementwise, OnlyOneOperandRequiresGrad) {
  Tensor a = random_leaf({3, 4}, 19), b = leaf(test::uniform_values(4, 20), {4}, cpu_device(0), false);
  EXPECT_TRUE(gradcheck([](L x) { return mul(x[0], x[1]); }, {a, b}));
  EXPECT_TRUE(gradcheck([](L x) { return div(x[1], x[0].add(3.0)); }, {a, b}));
}

TEST(GradcheckElementwise, ScalarOps) {
  Tensor a = random_leaf({2, 3}, 21);
  EXPECT_TRUE(gradcheck([](L x) { return add_scalar(x[0], 1.5); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return mul_scalar(x[0], -3.0); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return rsub_scalar(2.0, x[0]); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return 2.0 - x[0] * 4.0 + 1.0; }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return x[0] / 4.0 - 1.0; }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return -x[0]; }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return neg(x[0]); }, {a}));
}

TEST(GradcheckElementwise, Unary) {
  Tensor a = random_leaf({2, 3, 2}, 22);
  Tensor pos = random_leaf_in({2, 3, 2}, 23, 0.2, 2.0);
  Tensor off = away_from_zero_leaf({2, 3, 2}, 24);
  EXPECT_TRUE(gradcheck([](L x) { return exp(x[0]); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return tanh(x[0]); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return sigmoid(x[0]); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return log(x[0]); }, {pos}));
  EXPECT_TRUE(gradcheck([](L x) { return sqrt(x[0]); }, {pos}));
  EXPECT_TRUE(gradcheck([](L x) { return relu(x[0]); }, {off}));
  EXPECT_TRUE(gradcheck([](L x) { return abs(x[0]); }, {off}));
  EXPECT_TRUE(gradcheck([](L x) { return x[0].exp().log().sqrt(); }, {pos}));
}

TEST(GradcheckElementwise, Pow) {
  Tensor pos = random_leaf_in({3, 4}, 25, 0.2, 2.0);
  Tensor a = random_leaf({3, 4}, 26);
  EXPECT_TRUE(gradcheck([](L x) { return pow(x[0], 2.5); }, {pos}));
  EXPECT_TRUE(gradcheck([](L x) { return pow(x[0], -1.5); }, {pos}));
  EXPECT_TRUE(gradcheck([](L x) { return x[0].pow(3.0); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return x[0].pow(2.0); }, {a}));
}

// ---- non-contiguous operands ------------------------------------------------------------

TEST(GradcheckNonContiguous, TransposedOperand) {
  Tensor a = random_leaf({4, 3}, 30), b = random_leaf({3, 4}, 31);
  EXPECT_TRUE(gradcheck([](L x) { return mul(x[0].t(), x[1]); }, {a, b}));
  EXPECT_TRUE(gradcheck([](L x) { return exp(x[0].t()); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return add(x[1], x[0].transpose(0, 1)); }, {a, b}));
}

TEST(GradcheckNonContiguous, SlicedWithStep) {
  Tensor a = random_leaf({3, 7}, 32), b = random_leaf({3, 4}, 33);
  EXPECT_TRUE(gradcheck([](L x) { return mul(x[0].slice(1, 0, 7, 2), x[1]); }, {a, b}));
  EXPECT_TRUE(gradcheck([](L x) { return tanh(x[0].slice(1, 1, 7, 3)); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return x[0].slice(0, 0, 3, 2).slice(1, 2, 6, 1) * 2.0; }, {a}));
}

TEST(GradcheckNonContiguous, Expanded) {
  Tensor row = random_leaf({1, 4}, 34), vec = random_leaf({4}, 35), b = random_leaf({3, 4}, 36);
  EXPECT_TRUE(gradcheck([](L x) { return mul(x[0].expand({3, 4}), x[1]); }, {row, b}));
  EXPECT_TRUE(gradcheck([](L x) { return mul(x[0].expand({2, 3, 4}), x[1]); }, {vec, b}));
  EXPECT_TRUE(gradcheck([](L x) { return sigmoid(x[0].expand({5, -1})); }, {row}));
}

TEST(GradcheckNonContiguous, Permuted) {
  Tensor a = random_leaf({2, 3, 4}, 37), b = random_leaf({4, 2, 3}, 38);
  EXPECT_TRUE(gradcheck([](L x) { return add(x[0].permute({2, 0, 1}), x[1]); }, {a, b}));
  EXPECT_TRUE(gradcheck([](L x) { return mul(x[0].permute({2, 0, 1}), x[1].exp()); }, {a, b}));
  EXPECT_TRUE(gradcheck([](L x) { return x[0].permute({1, 2, 0}).sum({0, 2}); }, {a}));
}

// ---- reductions --------------------------------------------------------------------------

TEST(GradcheckReduce, SumOverSeveralDims) {
  Tensor a = random_leaf({2, 3, 4}, 40);
  EXPECT_TRUE(gradcheck([](L x) { return sum(x[0]); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return x[0].sum(); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return sum(x[0], {0, 2}); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return sum(x[0], {0, 2}, true); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return sum(x[0], {-1}); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return sum(x[0], {1}, true); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return sum(x[0].transpose(0, 2), {1, 2}); }, {a}));
}

TEST(GradcheckReduce, MeanOverSeveralDims) {
  Tensor a = random_leaf({2, 3, 4}, 41);
  EXPECT_TRUE(gradcheck([](L x) { return mean(x[0]); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return x[0].mean(); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return mean(x[0], {0, 2}); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return mean(x[0], {2, 0}, true); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return x[0].mean({1}); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return mean(x[0].permute({1, 0, 2}), {0}, true); }, {a}));
}

TEST(GradcheckReduce, MaxOverADim) {
  Tensor a = distinct_leaf({3, 4, 5}, 42);
  EXPECT_TRUE(gradcheck([](L x) { return amax(x[0], 1); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return amax(x[0], -1, true); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return x[0].max(0); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return x[0].max(); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return x[0].t().max(1, true); }, {distinct_leaf({4, 6}, 43)}));
}

// ---- matmul --------------------------------------------------------------------------------

TEST(GradcheckMatmul, TwoD) {
  Tensor a = random_leaf({3, 4}, 50), b = random_leaf({4, 5}, 51);
  EXPECT_TRUE(gradcheck([](L x) { return matmul(x[0], x[1]); }, {a, b}));
  EXPECT_TRUE(gradcheck([](L x) { return x[0].matmul(x[1]); }, {a, b}));
}

TEST(GradcheckMatmul, Batched) {
  Tensor a = random_leaf({2, 3, 4}, 52), b = random_leaf({2, 4, 5}, 53);
  EXPECT_TRUE(gradcheck([](L x) { return matmul(x[0], x[1]); }, {a, b}));
}

TEST(GradcheckMatmul, LeadingDimsTimesMatrix) {
  Tensor a = random_leaf({2, 3, 2, 4}, 54), b = random_leaf({4, 3}, 55);
  EXPECT_TRUE(gradcheck([](L x) { return matmul(x[0], x[1]); }, {a, b}));
  Tensor a3 = random_leaf({2, 3, 4}, 56);
  EXPECT_TRUE(gradcheck([](L x) { return matmul(x[0], x[1]); }, {a3, b}));
}

TEST(GradcheckMatmul, TransposedOperands) {
  Tensor a = random_leaf({4, 3}, 57), b = random_leaf({5, 4}, 58);
  EXPECT_TRUE(gradcheck([](L x) { return matmul(x[0].t(), x[1].t()); }, {a, b}));
  Tensor c = random_leaf({3, 4}, 59);
  EXPECT_TRUE(gradcheck([](L x) { return matmul(x[0], x[1].t()); }, {c, b}));
  Tensor d = random_leaf({4, 5}, 65);
  EXPECT_TRUE(gradcheck([](L x) { return matmul(x[0].t(), x[1]); }, {a, d}));
  Tensor ba = random_leaf({2, 4, 3}, 60), bb = random_leaf({2, 5, 4}, 61);
  EXPECT_TRUE(gradcheck([](L x) { return matmul(x[0].transpose(1, 2), x[1].transpose(1, 2)); }, {ba, bb}));
}

TEST(GradcheckMatmul, StridedOperands) {
  Tensor a = random_leaf({3, 8}, 62), b = random_leaf({6, 5}, 63);
  EXPECT_TRUE(gradcheck([](L x) { return matmul(x[0].slice(1, 0, 8, 2), x[1].narrow(0, 1, 4)); }, {a, b}));
  Tensor row = random_leaf({1, 4}, 64);
  EXPECT_TRUE(gradcheck([](L x) { return matmul(x[0].expand({3, 4}), x[1].narrow(0, 2, 4)); }, {row, b}));
}

// ---- joining and splitting -----------------------------------------------------------------

TEST(GradcheckJoin, Cat) {
  Tensor a = random_leaf({2, 3}, 70), b = random_leaf({2, 1}, 71), c = random_leaf({2, 4}, 72);
  EXPECT_TRUE(gradcheck([](L x) { return cat({x[0], x[1], x[2]}, 1); }, {a, b, c}));
  EXPECT_TRUE(gradcheck([](L x) { return cat({x[0].exp(), x[1], x[2] * 2.0}, -1); }, {a, b, c}));
  EXPECT_TRUE(gradcheck([](L x) { return cat({x[0].t(), x[1].t()}, 0); }, {a, b}));
}

TEST(GradcheckJoin, Stack) {
  Tensor a = random_leaf({2, 3}, 73), b = random_leaf({2, 3}, 74);
  EXPECT_TRUE(gradcheck([](L x) { return stack({x[0], x[1]}, 0); }, {a, b}));
  EXPECT_TRUE(gradcheck([](L x) { return stack({x[0], x[1].tanh(), x[0]}, 1); }, {a, b}));
  EXPECT_TRUE(gradcheck([](L x) { return stack({x[0], x[1]}, -1); }, {a, b}));
}

TEST(GradcheckJoin, SplitAndChunk) {
  Tensor a = random_leaf({3, 7}, 75);
  // Each piece goes through a different function, so a gradient routed to the
  // wrong piece shows up.
  EXPECT_TRUE(gradcheck([](L x) {
    TensorList p = split(x[0], 3, 1);  // sizes 3, 3, 1
    return cat({p[0] * 2.0, p[1].exp(), p[2].sigmoid()}, 1);
  }, {a}));
  EXPECT_TRUE(gradcheck([](L x) {
    TensorList p = split_sizes(x[0], {1, 2}, 0);
    return cat({p[1].tanh(), p[0] * -1.0}, 0);
  }, {a}));
  EXPECT_TRUE(gradcheck([](L x) {
    TensorList p = chunk(x[0], 3, 1);  // sizes 3, 3, 1
    return mul(p[0], p[1]).sum({1}, true).add(p[2]);
  }, {a}));
  // A piece that is not used gets no gradient (zeros).
  EXPECT_TRUE(gradcheck([](L x) { return chunk(x[0], 2, 0)[1].exp(); }, {a}));
}

// ---- indexing --------------------------------------------------------------------------------

TEST(GradcheckIndex, IndexSelectWithRepeats) {
  Tensor a = random_leaf({4, 3}, 80);
  Tensor i0 = idx({2, 0, 2, 3, 2}, {5});
  Tensor i1 = idx({1, 1, 0}, {3});
  EXPECT_TRUE(gradcheck([](L x) { return index_select(x[0], 0, x[1]); }, {a, i0}));
  EXPECT_TRUE(gradcheck([](L x) { return index_select(x[0], 1, x[1]); }, {a, i1}));
  EXPECT_TRUE(gradcheck([](L x) { return index_select(x[0].t(), -1, x[1]); }, {a, i0}));
}

TEST(GradcheckIndex, GatherWithRepeats) {
  Tensor a = random_leaf({3, 4}, 81);
  Tensor i1 = idx({0, 0, 3, 1, 2, 1, 3, 3, 3}, {3, 3});
  Tensor i0 = idx({2, 0, 1, 1, 0, 0, 2, 2}, {2, 4});
  EXPECT_TRUE(gradcheck([](L x) { return gather(x[0], 1, x[1]); }, {a, i1}));
  EXPECT_TRUE(gradcheck([](L x) { return gather(x[0], 0, x[1]); }, {a, i0}));
}

// ---- softmax --------------------------------------------------------------------------------

TEST(GradcheckSoftmax, MiddleAndLastDim) {
  Tensor a = random_leaf({2, 3, 4}, 90);
  EXPECT_TRUE(gradcheck([](L x) { return softmax(x[0], 1); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return log_softmax(x[0], 1); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return softmax(x[0], -1); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return log_softmax(x[0], 0); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return softmax(x[0].transpose(0, 2), 1); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return log_softmax(x[0].mul(3.0), -1); }, {a}));
}

// ---- views -----------------------------------------------------------------------------------

TEST(GradcheckViews, ShapeChanges) {
  Tensor a = random_leaf({2, 3, 4}, 100);
  EXPECT_TRUE(gradcheck([](L x) { return x[0].view({6, 4}) * 2.0; }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return x[0].view({-1}).exp(); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return x[0].reshape({4, 6}).tanh(); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return x[0].transpose(0, 2).reshape({4, 6}).tanh(); }, {a}));  // copies
  EXPECT_TRUE(gradcheck([](L x) { return x[0].flatten(1).sigmoid(); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return x[0].flatten().exp(); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return x[0].unsqueeze(1).unsqueeze(-1).exp(); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return x[0].narrow(1, 0, 1).squeeze(1).exp(); }, {a}));
}

TEST(GradcheckViews, SqueezeOfANonSingletonDimIsANoOp) {
  Tensor a = random_leaf({2, 3}, 101);
  EXPECT_TRUE(gradcheck([](L x) { return x[0].squeeze(0).exp(); }, {a}));
  EXPECT_TRUE(a.is_leaf());
}

TEST(GradcheckViews, Selections) {
  Tensor a = random_leaf({3, 4, 5}, 102);
  EXPECT_TRUE(gradcheck([](L x) { return x[0].select(1, 2).exp(); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return x[0].select(-1, -1) * 3.0; }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return x[0][1].tanh(); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return x[0].narrow(2, 1, 3).exp(); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return x[0].slice(2, 0, 5, 2).slice(0, 1, 3).exp(); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return x[0].slice(1, -3, -1).sigmoid(); }, {a}));
}

TEST(GradcheckViews, PermuteTransposeExpandCopy) {
  Tensor a = random_leaf({2, 3, 4}, 103), one = random_leaf({3, 1}, 104);
  EXPECT_TRUE(gradcheck([](L x) { return x[0].permute({2, 0, 1}).exp(); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return x[0].transpose(-1, 0).contiguous().exp(); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return x[0].expand({2, 3, 5}).exp(); }, {one}));
  EXPECT_TRUE(gradcheck([](L x) { return x[0].clone().mul(x[0]); }, {a}));
  EXPECT_TRUE(gradcheck([](L x) { return x[0].contiguous(); }, {a}));
}

// ---- dtype and device moves -------------------------------------------------------------

TEST(GradcheckMoves, ToDtype) {
  // Through float32: L is computed from float32 values, so the step must be far
  // above float's resolution (2^-24 relative) and the tolerance float-sized.
  Tensor a = random_leaf({3, 4}, 110);
  test::GradcheckOptions f32{1e-3, 1e-3, 1e-4};
  EXPECT_TRUE(gradcheck([](L x) { return to_dtype(x[0], kFloat32); }, {a}, f32));
  EXPECT_TRUE(gradcheck([](L x) { return x[0].to(kFloat32).mul(2.0).to(kFloat64).exp(); }, {a}, f32));
  // A no-op conversion is the identity.
  EXPECT_TRUE(gradcheck([](L x) { return to_dtype(x[0], kFloat64).exp(); }, {a}));
}

TEST(GradcheckMoves, ToDevice) {
  Tensor a = random_leaf({3, 4}, 111), b = random_leaf({3, 4}, 112, Device("cpu:1"));
  EXPECT_TRUE(gradcheck([](L x) { return x[0].to(Device("cpu:1")).mul(x[1]); }, {a, b}));
  EXPECT_TRUE(gradcheck([](L x) { return mul(x[1], x[0]).to(Device("cpu:2")).exp(); }, {a, b}));
}

// ---- nn functional ------------------------------------------------------------------------

namespace F = nn::functional;

TEST(GradcheckNN, Linear) {
  Tensor x = random_leaf({4, 3}, 120), w = random_leaf({5, 3}, 121), b = random_leaf({5}, 122);
  EXPECT_TRUE(gradcheck([](L v) { return F::linear(v[0], v[1], v[2]); }, {x, w, b}));
  EXPECT_TRUE(gradcheck([](L v) { return F::linear(v[0], v[1], Tensor()); }, {x, w}));
  Tensor x3 = random_leaf({2, 2, 3}, 123);
  EXPECT_TRUE(gradcheck([](L v) { return F::linear(v[0], v[1], v[2]); }, {x3, w, b}));
}

TEST(GradcheckNN, MseLoss) {
  Tensor a = random_leaf({3, 4}, 124), b = random_leaf({3, 4}, 125);
  EXPECT_TRUE(gradcheck([](L v) { return F::mse_loss(v[0], v[1]); }, {a, b}));
}

TEST(GradcheckNN, CrossEntropy) {
  Tensor logits = random_leaf({4, 5}, 126);
  Tensor target = idx({1, 0, 4, 1}, {4});
  EXPECT_TRUE(gradcheck([](L v) { return F::cross_entropy(v[0], v[1]); }, {logits, target}));
  EXPECT_TRUE(gradcheck([](L v) { return F::cross_entropy(v[0], v[1], 0.2); }, {logits, target}));
  EXPECT_TRUE(gradcheck([](L v) { return F::cross_entropy(v[0].mul(4.0), v[1], 0.1); }, {logits, target}));
}

TEST(GradcheckNN, DropoutWithAFixedMask) {
  Tensor x = away_from_zero_leaf({4, 6}, 127);
  // Reseeding inside f gives every evaluation the same mask.
  auto f = [](L v) {
    manual_seed(1234);
    return F::dropout(v[0], 0.4, true);
  };
  EXPECT_TRUE(gradcheck(f, {x}));
  // The gradient is the mask, recovered from the output: y / x in {0, 1/(1-p)}.
  x.zero_grad();
  Tensor y = f({x});
  y.sum().backward();
  std::vector<double> xv = x.to_vector<double>(), yv = y.to_vector<double>(), gv = x.grad().to_vector<double>();
  const double scale = static_cast<double>(static_cast<float>(1.0 / 0.6));
  int kept = 0;
  for (size_t i = 0; i < xv.size(); ++i) {
    double m = yv[i] / xv[i];
    EXPECT_TRUE(m == 0.0 || std::abs(m - scale) < 1e-12) << "element " << i << ": mask " << m;
    EXPECT_DOUBLE_EQ(gv[i], m) << "element " << i;
    kept += m != 0.0;
  }
  EXPECT_GT(kept, 0);
  EXPECT_LT(kept, static_cast<int>(xv.size()));
  // Evaluation mode (and p = 0) is the identity.
  EXPECT_TRUE(gradcheck([](L v) { return F::dropout(v[0], 0.4, false).exp(); }, {x}));
}

// Convolution, pooling and batch norm run in float64 like every other op: the
// CPU kernel set routes float64 tensors to the naive double kernels of
// cpu/nn_kernels_f64.h, so these checks use the default tight tolerances.

TEST(GradcheckNN, Conv2d) {
  // Stride, padding, dilation, groups and bias together, then one at a time.
  Tensor x = random_leaf({2, 4, 6, 5}, 130), w = random_leaf({4, 2, 3, 3}, 131), b = random_leaf({4}, 132);
  EXPECT_TRUE(gradcheck([](L v) {
    return F::conv2d(v[0], v[1], v[2], Conv2dParams{2, 1, 1, 2, 2, 1, 2});
  }, {x, w, b}));
  Tensor w1 = random_leaf({3, 4, 3, 2}, 133);
  EXPECT_TRUE(gradcheck([](L v) { return F::conv2d(v[0], v[1], Tensor(), Conv2dParams{}); }, {x, w1}));
  Tensor b3 = random_leaf({3}, 134);
  EXPECT_TRUE(gradcheck([](L v) {
    return F::conv2d(v[0], v[1], v[2], Conv2dParams{1, 2, 1, 0, 1, 1, 1});
  }, {x, w1, b3}));
  Tensor wd = random_leaf({3, 4, 2, 2}, 135);
  EXPECT_TRUE(gradcheck([](L v) {
    return F::conv2d(v[0], v[1], Tensor(), Conv2dParams{1, 1, 0, 0, 2, 2, 1});
  }, {x, wd}));
  // Groups equal to the channel count (depthwise), on a transposed input view.
  Tensor xt = random_leaf({2, 4, 5, 6}, 136), wdw = random_leaf({4, 1, 3, 3}, 137);
  EXPECT_TRUE(gradcheck([](L v) {
    return F::conv2d(v[0].transpose(2, 3), v[1], Tensor(), Conv2dParams{1, 1, 1, 1, 1, 1, 4});
  }, {xt, wdw}));
}

// conv2d + residual in one op (a residual block's last convolution): the
// residual's gradient is the output's, the others the convolution's; with a
// bias it is the two ops.
TEST(GradcheckNN, Conv2dAdd) {
  Tensor x = random_leaf({2, 4, 6, 5}, 140), w = random_leaf({4, 2, 3, 3}, 141);
  Tensor r = random_leaf({2, 4, 2, 7}, 142), b = random_leaf({4}, 143);
  EXPECT_TRUE(gradcheck([](L v) {
    return F::conv2d_add(v[0], v[1], Tensor(), v[2], Conv2dParams{2, 1, 1, 2, 2, 1, 2});
  }, {x, w, r}));
  EXPECT_TRUE(gradcheck([](L v) {
    return F::conv2d_add(v[0], v[1], v[3], v[2], Conv2dParams{2, 1, 1, 2, 2, 1, 2});
  }, {x, w, r, b}));
  // A residual that is a strided view (transposed), as a shortcut may be.
  Tensor w2 = random_leaf({3, 4, 3, 3}, 144), rt = random_leaf({2, 3, 5, 6}, 145);
  EXPECT_TRUE(gradcheck([](L v) {
    return F::conv2d_add(v[0], v[1], Tensor(), v[2].transpose(2, 3), Conv2dParams{1, 1, 1, 1, 1, 1, 1});
  }, {x, w2, rt}));
}

TEST(GradcheckNN, MaxPool2d) {
  // Values 0.05 apart (step 1e-6): the winner of every window never changes.
  Tensor x = distinct_leaf({2, 2, 6, 5}, 140);
  EXPECT_TRUE(gradcheck([](L v) { return F::max_pool2d(v[0], Pool2dParams{2, 2, 2, 2}); }, {x}));
  EXPECT_TRUE(gradcheck([](L v) { return F::max_pool2d(v[0], Pool2dParams{3, 3, 2, 2, 1, 1}); }, {x}));
  EXPECT_TRUE(gradcheck([](L v) { return F::max_pool2d(v[0], Pool2dParams{3, 2, 1, 2, 1, 0}); }, {x}));
}

TEST(GradcheckNN, AvgPool2d) {
  Tensor x = random_leaf({2, 2, 6, 5}, 141);
  EXPECT_TRUE(gradcheck([](L v) { return F::avg_pool2d(v[0], Pool2dParams{2, 2, 2, 2}); }, {x}));
  EXPECT_TRUE(gradcheck([](L v) { return F::avg_pool2d(v[0], Pool2dParams{3, 3, 2, 2, 1, 1}); }, {x}));
  EXPECT_TRUE(gradcheck([](L v) { return F::avg_pool2d(v[0], Pool2dParams{3, 2, 1, 2, 1, 0}); }, {x}));
}

TEST(GradcheckNN, AdaptiveAvgPool2d) {
  Tensor x = random_leaf({2, 2, 5, 7}, 142);
  EXPECT_TRUE(gradcheck([](L v) { return F::adaptive_avg_pool2d(v[0], 3, 2); }, {x}));
  EXPECT_TRUE(gradcheck([](L v) { return F::adaptive_avg_pool2d(v[0], 1, 1); }, {x}));
  EXPECT_TRUE(gradcheck([](L v) { return F::adaptive_avg_pool2d(v[0], 4, 9); }, {x}));
}

TEST(GradcheckNN, BatchNormTraining) {
  Tensor x = random_leaf({3, 2, 2, 3}, 150), w = random_leaf_in({2}, 151, 0.5, 1.5), b = random_leaf({2}, 152);
  // Running statistics are updated in place at every evaluation; they do not
  // affect the training-mode output.
  Tensor rm = zeros({2}), rv = ones({2});
  auto f = [rm, rv](L v) { return F::batch_norm(v[0], rm, rv, v[1], v[2], true, 0.1, 1e-5); };
  EXPECT_TRUE(gradcheck(f, {x, w, b}));
  // [N, C] input, no running statistics.
  Tensor x2 = random_leaf({5, 3}, 153), w2 = random_leaf_in({3}, 154, 0.5, 1.5), b2 = random_leaf({3}, 155);
  EXPECT_TRUE(gradcheck([](L v) {
    return F::batch_norm(v[0], Tensor(), Tensor(), v[1], v[2], true, 0.1, 1e-5);
  }, {x2, w2, b2}));
  // No affine parameters.
  EXPECT_TRUE(gradcheck([](L v) { return F::batch_norm(v[0], Tensor(), Tensor(), Tensor(), Tensor(), true, 0.1, 1e-5); },
                        {x2}));
}

// The fused batch norm + ReLU: its gradient is ReLU's mask applied before
// batch norm's backward; and it equals relu(batch_norm(x)) exactly.
TEST(GradcheckNN, BatchNormReluTraining) {
  Tensor x = random_leaf({4, 3, 2, 3}, 170), w = random_leaf_in({3}, 171, 0.5, 1.5), b = random_leaf({3}, 172);
  Tensor rm = zeros({3}), rv = ones({3});
  auto f = [rm, rv](L v) { return F::batch_norm_relu(v[0], rm, rv, v[1], v[2], true, 0.1, 1e-5); };
  EXPECT_TRUE(gradcheck(f, {x, w, b}));
  const Tensor fused = F::batch_norm_relu(x, Tensor(), Tensor(), w, b, true, 0.1, 1e-5);
  const Tensor plain = F::batch_norm(x, Tensor(), Tensor(), w, b, true, 0.1, 1e-5).relu();
  const std::vector<double> fv = fused.to_vector<double>(), pv = plain.to_vector<double>();
  EXPECT_EQ(fv, pv);
  // Evaluation mode is the two ops.
  const std::vector<double> ev = F::batch_norm_relu(x, rm, rv, w, b, false, 0.1, 1e-5).to_vector<double>();
  const std::vector<double> rv2 = F::batch_norm(x, rm, rv, w, b, false, 0.1, 1e-5).relu().to_vector<double>();
  EXPECT_EQ(ev, rv2);
}

// A residual join, x -> relu(bn(x)) + x as in a pre-activation block: x's two
// gradients meet at one slot and the batch norm's backward adds the pending
// one in its own pass (Note [Gradient addends]). Also x used three times (no
// addend: three gradients) and the join after a non-leaf.
TEST(GradcheckNN, BatchNormReluResidualJoin) {
  Tensor x = random_leaf({4, 3, 2, 3}, 173), w = random_leaf_in({3}, 174, 0.5, 1.5), b = random_leaf({3}, 175);
  auto join = [](L v) { return add(F::batch_norm_relu(v[0], Tensor(), Tensor(), v[1], v[2], true, 0.1, 1e-5), v[0]); };
  EXPECT_TRUE(gradcheck(join, {x, w, b}));
  auto after = [](L v) {
    const Tensor h = mul(v[0], v[0]);
    return add(F::batch_norm_relu(h, Tensor(), Tensor(), v[1], v[2], true, 0.1, 1e-5), h);
  };
  EXPECT_TRUE(gradcheck(after, {x, w, b}));
  auto thrice = [](L v) {
    const Tensor y = F::batch_norm_relu(v[0], Tensor(), Tensor(), v[1], v[2], true, 0.1, 1e-5);
    return add(add(y, v[0]), mul(v[0], v[0]));
  };
  EXPECT_TRUE(gradcheck(thrice, {x, w, b}));
}

// The batch norm over a sum left unsummed (Note [Residual add left to the
// batch norm] in ops/nn.h): both outputs, s = a + b and relu(bn(s)), weighed
// into the loss, and s used once more as a residual block's identity path.
TEST(GradcheckNN, BatchNormReluOfASum) {
  Tensor a = random_leaf({4, 3, 2, 3}, 176), b = random_leaf({4, 3, 2, 3}, 177);
  Tensor w = random_leaf_in({3}, 178, 0.5, 1.5), bias = random_leaf({3}, 179);
  Tensor rm = zeros({3}), rv = ones({3});
  auto f = [rm, rv](L v) {
    auto [s, y] = F::batch_norm_relu_sum(v[0], v[1], rm, rv, v[2], v[3], true, 0.1, 1e-5);
    return add(y, mul(s, s));
  };
  EXPECT_TRUE(gradcheck(f, {a, b, w, bias}));
}

// A tied embedding (Note [Gradient addends]): one table looked up with
// repeated ids and used as the output projection. The lookup's backward adds
// its rows into the projection's gradient in place when that gradient waits
// at the table's slot (F::linear's weight gradient: contiguous), and beside it
// when it cannot (the transpose's gradient, a strided view); the ids once
// more after the projection (three gradients: none offered).
TEST(GradcheckNN, TiedEmbeddingLookupAndProjection) {
  const Tensor w = random_leaf({7, 4}, 181), ids = idx({3, 1, 3, 6, 0}, {5});
  auto linear = [ids](L v) { return nn::functional::linear(index_select(v[0], 0, ids), v[0], Tensor()); };
  EXPECT_TRUE(gradcheck(linear, {w}));
  auto strided = [ids](L v) { return matmul(index_select(v[0], 0, ids), v[0].t()); };
  EXPECT_TRUE(gradcheck(strided, {w}));
  auto thrice = [ids](L v) {
    const Tensor logits = nn::functional::linear(index_select(v[0], 0, ids), v[0], Tensor());
    return add(logits.sum(), index_select(v[0], 0, ids).sum());
  };
  EXPECT_TRUE(gradcheck(thrice, {w}));
}

// The engine's side of Note [Gradient addends], with nodes of the test's own:
// an addend is offered only where a slot expects two gradients and holds one,
// a node that takes it returns the sum, and one a node leaves goes back to its
// slot and is added as before.
TEST(AutogradAddends, OfferedTakenAndReturned) {
  for (bool take : {true, false}) {
    Tensor x = leaf({1.0, -2.0, 0.5}, {3});
    const Tensor h = mul(x, x);  // a non-leaf: its slot is a node's, not AccumulateGrad's
    int offered = 0;
    // f(h) = 3 h, whose backward may take h's other gradient.
    Tensor y = autograd::record("TakesAddend", ops::unary(UnaryOp::MulScalar, h.detach(), 3.0), {h},
                                [&](const TensorList& g) {
                                  Tensor gx = ops::unary(UnaryOp::MulScalar, g[0], 3.0);
                                  if (!take) return TensorList{gx};
                                  const Tensor a = autograd::take_gradient_addend(0);
                                  if (a.defined()) {
                                    ++offered;
                                    gx = ops::binary(BinaryOp::Add, gx, a, 1.0);
                                  }
                                  return TensorList{gx};
                                });
    y.grad_fn()->takes_addends = true;
    // loss = sum(r * (f(h) + 5 h)): dh = 3 r + 5 r; dx = 2 x dh.
    const Tensor r = leaf({0.5, 1.5, -1.0}, {3}, cpu_device(0), false);
    mul(add(y, mul(h, leaf({5.0, 5.0, 5.0}, {3}, cpu_device(0), false))), r).sum().backward();
    const std::vector<double> g = x.grad().to_vector<double>(), xv{1.0, -2.0, 0.5}, rv{0.5, 1.5, -1.0};
    for (size_t i = 0; i < 3; ++i) EXPECT_DOUBLE_EQ(g[i], 2 * xv[i] * 8 * rv[i]) << (take ? "taken" : "left");
    EXPECT_EQ(offered, take ? 1 : 0);
  }
  // Three gradients meet at h's slot: nothing is offered.
  Tensor x = leaf({1.0, -2.0, 0.5}, {3});
  const Tensor h = mul(x, x);
  int offered = 0;
  Tensor y = autograd::record("TakesAddend", h.detach(), TensorList{h}, [&](const TensorList& g) {
    const Tensor a = autograd::take_gradient_addend(0);
    if (a.defined()) ++offered;
    return TensorList{a.defined() ? ops::binary(BinaryOp::Add, g[0], a, 1.0) : g[0]};
  });
  y.grad_fn()->takes_addends = true;
  add(add(y, h), h).sum().backward();
  const std::vector<double> g = x.grad().to_vector<double>();
  EXPECT_EQ(offered, 0);
  EXPECT_DOUBLE_EQ(g[1], 2 * -2.0 * 3);
}

TEST(GradcheckNN, BatchNormEval) {
  Tensor x = random_leaf({3, 2, 2, 3}, 156), w = random_leaf_in({2}, 157, 0.5, 1.5), b = random_leaf({2}, 158);
  Tensor rm = from_vector(std::vector<float>{0.3f, -0.2f}, {2}), rv = from_vector(std::vector<float>{0.8f, 1.7f}, {2});
  auto f = [rm, rv](L v) { return F::batch_norm(v[0], rm, rv, v[1], v[2], false, 0.1, 1e-5); };
  EXPECT_TRUE(gradcheck(f, {x, w, b}));
  // Only the bias requires grad: the output must still be recorded.
  Tensor xc = leaf(test::uniform_values(36, 159), {3, 2, 2, 3}, cpu_device(0), false);
  Tensor wc = leaf({1.2, 0.7}, {2}, cpu_device(0), false);
  EXPECT_TRUE(gradcheck([xc, wc, f](L v) { return f({xc, wc, v[0]}); }, {b}));
}

}  // namespace
}  // namespace chorus
