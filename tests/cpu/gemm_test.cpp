// gemm / gemm_batched against a triple loop in double, on random inputs with
// padded leading dimensions, every transpose combination, and the BLAS
// corner cases the convolution relies on (beta = 0 ignores C, k = 0).
#include "testing/random.h"
#include "chorus/cpu/gemm.h"

#include <cblas.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <stdexcept>
#include <vector>

namespace chorus::cpu {
namespace {

using chorus::testing::random_vector;

struct Case {
  bool ta, tb;
  int64_t m, n, k;
  int64_t pad;  // extra columns in every leading dimension
  float alpha, beta;
};

// C = alpha * op(A) op(B) + beta * C in double, row-major with the given lds.
std::vector<double> ref_gemm(const Case& t, const std::vector<float>& a, int64_t lda,
                             const std::vector<float>& b, int64_t ldb, const std::vector<float>& c,
                             int64_t ldc) {
  std::vector<double> out(c.begin(), c.end());
  for (int64_t i = 0; i < t.m; ++i)
    for (int64_t j = 0; j < t.n; ++j) {
      double s = 0.0;
      for (int64_t p = 0; p < t.k; ++p) {
        const double av = t.ta ? a[p * lda + i] : a[i * lda + p];
        const double bv = t.tb ? b[j * ldb + p] : b[p * ldb + j];
        s += av * bv;
      }
      out[i * ldc + j] = t.alpha * s + (t.beta == 0.0f ? 0.0 : t.beta * double(c[i * ldc + j]));
    }
  return out;
}

void check(const Case& t, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "ta=" << t.ta << " tb=" << t.tb << " m=" << t.m
                                    << " n=" << t.n << " k=" << t.k << " pad=" << t.pad);
  const int64_t a_rows = t.ta ? t.k : t.m, a_cols = t.ta ? t.m : t.k;
  const int64_t b_rows = t.tb ? t.n : t.k, b_cols = t.tb ? t.k : t.n;
  const int64_t lda = a_cols + t.pad, ldb = b_cols + t.pad, ldc = t.n + t.pad;
  const auto a = random_vector(a_rows * lda, seed);
  const auto b = random_vector(b_rows * ldb, seed + 1);
  auto c = random_vector(t.m * ldc, seed + 2);
  const auto want = ref_gemm(t, a, lda, b, ldb, c, ldc);
  gemm(t.ta, t.tb, t.m, t.n, t.k, t.alpha, a.data(), lda, b.data(), ldb, t.beta, c.data(), ldc);
  for (int64_t i = 0; i < t.m * ldc; ++i) {
    // Padding columns of C must be untouched (want holds their old values).
    ASSERT_NEAR(c[i], want[i], 1e-4 * std::max(1.0, std::abs(want[i]))) << "at index " << i;
  }
}

TEST(GemmCpu, AllTransposesMatchReference) {
  uint32_t seed = 1;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      check({ta, tb, 17, 23, 31, 0, 1.0f, 0.0f}, seed += 3);
      check({ta, tb, 5, 64, 9, 3, 0.5f, 1.0f}, seed += 3);
      check({ta, tb, 64, 1, 130, 1, -2.0f, 0.25f}, seed += 3);
      check({ta, tb, 1, 1, 1, 0, 1.0f, -1.0f}, seed += 3);
    }
}

TEST(GemmCpu, LargeEnoughForOpenBlasThreads) {
  check({false, false, 200, 300, 250, 0, 1.0f, 0.0f}, 100);
  check({true, false, 129, 257, 65, 2, 1.0f, 1.0f}, 101);
}

TEST(GemmCpu, BetaZeroIgnoresNaNInC) {
  const auto a = random_vector(6, 1), b = random_vector(6, 2);
  std::vector<float> c(4, std::nanf(""));
  gemm(false, false, 2, 2, 3, 1.0f, a.data(), 3, b.data(), 2, 0.0f, c.data(), 2);
  for (float v : c) EXPECT_FALSE(std::isnan(v));
}

TEST(GemmCpu, EmptyInnerDimensionScalesC) {
  std::vector<float> c = {1.0f, -2.0f, 3.0f, 4.0f};
  gemm(false, false, 2, 2, 0, 1.0f, nullptr, 1, nullptr, 2, 0.5f, c.data(), 2);
  EXPECT_EQ(c, (std::vector<float>{0.5f, -1.0f, 1.5f, 2.0f}));
  std::vector<float> nan_c(4, std::nanf(""));
  gemm(false, false, 2, 2, 0, 1.0f, nullptr, 1, nullptr, 2, 0.0f, nan_c.data(), 2);
  EXPECT_EQ(nan_c, std::vector<float>(4, 0.0f));
  gemm(false, false, 0, 2, 3, 1.0f, nullptr, 3, nullptr, 2, 0.0f, nullptr, 2);  // no-op
}

TEST(GemmCpu, BatchedMatchesLoopIncludingBroadcastOperand) {
  const int64_t batch = 3, m = 4, n = 5, k = 6;
  const auto a = random_vector(batch * m * k, 10);
  const auto b = random_vector(k * n, 11);  // shared: stride 0
  auto c = random_vector(batch * m * n, 12);
  auto want = c;
  for (int64_t i = 0; i < batch; ++i) {
    gemm(false, false, m, n, k, 1.5f, a.data() + i * m * k, k, b.data(), n, 0.5f,
         want.data() + i * m * n, n);
  }
  gemm_batched(false, false, m, n, k, 1.5f, a.data(), k, m * k, b.data(), n, 0, 0.5f, c.data(), n,
               m * n, batch);
  EXPECT_EQ(c, want);

  // And against the double reference for one transposed batch entry.
  std::vector<float> c2(batch * m * n, std::nanf(""));
  gemm_batched(true, false, m, n, k, 1.0f, a.data(), m, m * k, b.data(), n, 0, 0.0f, c2.data(), n,
               m * n, batch);
  const std::vector<float> a1(a.begin() + m * k, a.begin() + 2 * m * k);
  const std::vector<float> c1(c2.begin() + m * n, c2.begin() + 2 * m * n);
  const auto ref = ref_gemm({true, false, m, n, k, 0, 1.0f, 0.0f}, a1, m, b, n,
                            std::vector<float>(m * n, 0.0f), n);
  for (int64_t i = 0; i < m * n; ++i) EXPECT_NEAR(c1[i], ref[i], 1e-4);
}

TEST(GemmCpu, SerialBlasScopeNestsAndRestoresThreadCount) {
  const int before = openblas_get_num_threads();
  {
    SerialBlasScope outer;
    EXPECT_EQ(openblas_get_num_threads(), 1);
    {
      SerialBlasScope inner;
      EXPECT_EQ(openblas_get_num_threads(), 1);
    }
    EXPECT_EQ(openblas_get_num_threads(), 1);  // still inside outer
    check({false, true, 70, 90, 110, 1, 1.0f, 0.5f}, 200);
  }
  EXPECT_EQ(openblas_get_num_threads(), before);
}

TEST(GemmCpu, RejectsBadArguments) {
  std::vector<float> buf(64, 0.5f);
  // lda below k for a non-transposed A.
  EXPECT_THROW(gemm(false, false, 2, 2, 3, 1.0f, buf.data(), 2, buf.data(), 2, 0.0f, buf.data(), 2),
               std::invalid_argument);
  // ldb below n for a non-transposed B.
  EXPECT_THROW(gemm(false, false, 2, 4, 3, 1.0f, buf.data(), 3, buf.data(), 3, 0.0f, buf.data(), 4),
               std::invalid_argument);
  EXPECT_THROW(
      gemm(false, false, -1, 2, 3, 1.0f, buf.data(), 3, buf.data(), 2, 0.0f, buf.data(), 2),
      std::invalid_argument);
  EXPECT_THROW(gemm(false, false, int64_t{1} << 32, 1, 1, 1.0f, buf.data(), 1, buf.data(), 1, 0.0f,
                    buf.data(), 1),
               std::invalid_argument);
  EXPECT_THROW(gemm_batched(false, false, 2, 2, 2, 1.0f, buf.data(), 2, 4, buf.data(), 2, 4, 0.0f,
                            buf.data(), 2, 0, 2),
               std::invalid_argument);
  try {
    gemm(true, false, 3, 2, 4, 1.0f, buf.data(), 2, buf.data(), 2, 0.0f, buf.data(), 2);
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("gemm"), std::string::npos) << what;
    EXPECT_NE(what.find("lda=2"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace chorus::cpu
