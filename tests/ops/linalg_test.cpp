// matmul against a triple loop in double: 2-d, batched, [..., M, K] @ [K, N],
// transposed and strided operands, float32 / bfloat16 / float64, errors.
#include <gtest/gtest.h>

#include <chorus/chorus.h>

#include "testing/expect_error.h"
#include "testing/gradcheck.h"

namespace chorus {
namespace {

using test::uniform_values;

// C[b] = A[b] @ B[b] for row-major host arrays; batch 1 when b_batch == 0 (B shared).
std::vector<double> naive_matmul(const std::vector<float>& a, const std::vector<float>& b, int64_t batch,
                                 int64_t m, int64_t k, int64_t n, bool b_shared) {
  std::vector<double> c(batch * m * n, 0.0);
  for (int64_t p = 0; p < batch; ++p)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (int64_t q = 0; q < k; ++q)
          s += static_cast<double>(a[(p * m + i) * k + q]) * b[(b_shared ? 0 : p * k * n) + q * n + j];
        c[(p * m + i) * n + j] = s;
      }
  return c;
}

void expect_close(const std::vector<float>& got, const std::vector<double>& want, double tol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], tol) << "element " << i;
}

Tensor rnd(const Shape& s, uint64_t seed) { return from_vector(uniform_values(numel_of(s), seed), s); }

TEST(OpsMatmul, TwoD) {
  for (auto [m, k, n] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{{3, 4, 5}, {1, 7, 1}, {17, 33, 9}, {64, 64, 64}}) {
    Tensor a = rnd({m, k}, 1), b = rnd({k, n}, 2);
    Tensor c = matmul(a, b);
    EXPECT_EQ(c.sizes(), (Shape{m, n}));
    expect_close(c.to_vector<float>(), naive_matmul(a.to_vector<float>(), b.to_vector<float>(), 1, m, k, n, true),
                 1e-5 * k);
  }
}

TEST(OpsMatmul, Batched) {
  Tensor a = rnd({3, 4, 5}, 3), b = rnd({3, 5, 6}, 4);
  Tensor c = a.matmul(b);
  EXPECT_EQ(c.sizes(), (Shape{3, 4, 6}));
  expect_close(c.to_vector<float>(), naive_matmul(a.to_vector<float>(), b.to_vector<float>(), 3, 4, 5, 6, false), 1e-5);
}

TEST(OpsMatmul, LeadingDimsTimesAMatrix) {
  Tensor a = rnd({2, 3, 4, 5}, 5), b = rnd({5, 6}, 6);
  Tensor c = matmul(a, b);
  EXPECT_EQ(c.sizes(), (Shape{2, 3, 4, 6}));
  expect_close(c.to_vector<float>(), naive_matmul(a.to_vector<float>(), b.to_vector<float>(), 6, 4, 5, 6, true), 1e-5);
}

TEST(OpsMatmul, TransposedAndStridedOperands) {
  Tensor at = rnd({5, 4}, 7), bt = rnd({6, 5}, 8);
  std::vector<float> a = at.t().contiguous().to_vector<float>(), b = bt.t().contiguous().to_vector<float>();
  std::vector<double> want = naive_matmul(a, b, 1, 4, 5, 6, true);
  expect_close(matmul(at.t(), bt.t()).to_vector<float>(), want, 1e-5);
  expect_close(matmul(at.t(), bt.t().contiguous()).to_vector<float>(), want, 1e-5);
  expect_close(matmul(at.t().contiguous(), bt.t()).to_vector<float>(), want, 1e-5);
  // Batched transposes.
  Tensor ba = rnd({2, 5, 4}, 9), bb = rnd({2, 6, 5}, 10);
  expect_close(matmul(ba.transpose(1, 2), bb.transpose(1, 2)).to_vector<float>(),
               naive_matmul(ba.transpose(1, 2).contiguous().to_vector<float>(),
                            bb.transpose(1, 2).contiguous().to_vector<float>(), 2, 4, 5, 6, false),
               1e-5);
  // Column slices, row slices with an offset, a stepped slice, an expanded row.
  Tensor wide = rnd({4, 12}, 11), tall = rnd({9, 6}, 12);
  Tensor sa = wide.slice(1, 1, 11, 2), sb = tall.narrow(0, 3, 5);
  expect_close(matmul(sa, sb).to_vector<float>(),
               naive_matmul(sa.contiguous().to_vector<float>(), sb.contiguous().to_vector<float>(), 1, 4, 5, 6, true),
               1e-5);
  Tensor row = rnd({1, 5}, 13).expand({4, 5});
  expect_close(matmul(row, sb).to_vector<float>(),
               naive_matmul(row.contiguous().to_vector<float>(), sb.contiguous().to_vector<float>(), 1, 4, 5, 6, true),
               1e-5);
}

TEST(OpsMatmul, DtypesAndEmptyInner) {
  Tensor a = rnd({3, 4}, 14), b = rnd({4, 2}, 15);
  // float64 is exact to double.
  Tensor c64 = matmul(a.to(kFloat64), b.to(kFloat64));
  EXPECT_EQ(c64.dtype(), kFloat64);
  std::vector<double> want = naive_matmul(a.to_vector<float>(), b.to_vector<float>(), 1, 3, 4, 2, true);
  std::vector<double> got = c64.to_vector<double>();
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-14);
  // bfloat16 operands: float accumulation of the rounded inputs, rounded once.
  Tensor abf = a.to(kBFloat16), bbf = b.to(kBFloat16);
  Tensor cbf = matmul(abf, bbf);
  EXPECT_EQ(cbf.dtype(), kBFloat16);
  std::vector<double> wbf = naive_matmul(abf.to_vector<float>(), bbf.to_vector<float>(), 1, 3, 4, 2, true);
  std::vector<float> gbf = cbf.to_vector<float>();
  for (size_t i = 0; i < wbf.size(); ++i) EXPECT_NEAR(gbf[i], wbf[i], 1e-2 * std::max(1.0, std::abs(wbf[i])));
  // Mixed dtypes promote.
  EXPECT_EQ(matmul(a, b.to(kFloat64)).dtype(), kFloat64);
  // K = 0 gives zeros.
  Tensor z = matmul(zeros({3, 0}), zeros({0, 2}));
  EXPECT_EQ(z.sizes(), (Shape{3, 2}));
  EXPECT_EQ(z.to_vector<float>(), std::vector<float>(6, 0.0f));
  // Issue 15: a batched [2, 3, 0] @ [0, 4] divided by K (SIGFPE); zeros, as in PyTorch.
  Tensor zb = matmul(rnd({2, 3, 0}, 16), rnd({0, 4}, 17));
  EXPECT_EQ(zb.sizes(), (Shape{2, 3, 4}));
  EXPECT_EQ(zb.to_vector<float>(), std::vector<float>(24, 0.0f));
  Tensor zbb = matmul(rnd({2, 3, 0}, 18), rnd({2, 0, 4}, 19));
  EXPECT_EQ(zbb.sizes(), (Shape{2, 3, 4}));
  EXPECT_EQ(zbb.to_vector<float>(), std::vector<float>(24, 0.0f));
  // Across logical devices: runs on the first operand's device.
  Tensor cd = matmul(a.to(Device("cpu:1")), b);
  EXPECT_EQ(cd.device(), cpu_device(1));
  expect_close(cd.to_vector<float>(), want, 1e-5);
}

TEST(OpsMatmul, ShapeErrorsNameMatmulAndTheShapes) {
  auto expect_error = [](const Tensor& a, const Tensor& b, const std::string& sa, const std::string& sb) {
    EXPECT_TRUE(test::throws_naming([&] { matmul(a, b); }, {"matmul", sa, sb}));
  };
  expect_error(zeros({3, 4}), zeros({5, 6}), "[3, 4]", "[5, 6]");
  expect_error(zeros({2, 3, 4}), zeros({3, 4, 5}), "[2, 3, 4]", "[3, 4, 5]");  // batch sizes differ
  expect_error(zeros({4}), zeros({4, 5}), "[4]", "[4, 5]");
  expect_error(zeros({2, 3, 4}), zeros({1, 2, 4, 5}), "[2, 3, 4]", "[1, 2, 4, 5]");
  EXPECT_THROW(matmul(zeros({2, 2}, {kInt64}), zeros({2, 2}, {kInt64})), ValueError);
}

}  // namespace
}  // namespace chorus
