// Note [Timed GEMM algorithm search] (cuda/blas/gemm_search.h): products
// whose algorithm was timed, or taken from the heuristic untimed, against
// float64 products of the same rounded inputs; epilogue outputs (bias, bias
// gradient) overwritten, not accumulated, by the search's repeated runs; an
// accumulating product (beta != 0) of a searched problem adds once; and which
// calls search (eager beta == 0, once per problem) and which do not.
// Tolerances are gemm_conv_test.cpp's: max|gpu - ref| / max|ref| within 1e-5
// for float32 (TF32 off), 2e-2 for bfloat16 outputs.
#ifdef CHORUS_WITH_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <chorus/chorus.h>
#include <chorus/cuda/blas/blas.h>
#include <chorus/cuda/blas/gemm_search.h>
#include <chorus/cuda/kernels/kernels.h>

// A namespace of its own: the unity build batches this file with others
// that have helpers of the same names (doubles, expect_close).
namespace chorus::gemm_search_test {
namespace {

std::vector<double> doubles(const Tensor& t) { return t.to(cpu_device(0), kFloat64).contiguous().to_vector<double>(); }

double tolerance(DType dt) { return dt == kFloat32 ? 1e-5 : 2e-2; }

void expect_close(const std::vector<double>& got, const std::vector<double>& want, double tol, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double err = 0, scale = 1e-30;
  for (size_t i = 0; i < got.size(); ++i) {
    const double e = std::abs(got[i] - want[i]);
    err = std::isnan(e) ? INFINITY : std::max(err, e);
    scale = std::max(scale, std::abs(want[i]));
  }
  EXPECT_LE(err / scale, tol) << what << ": max |gpu - ref| / max |ref|";
}

// ref[i, j] = sum_k op(a)[i, k] * op(b)[k, j] in float64, from row-major a and b.
std::vector<double> product(const std::vector<double>& a, const std::vector<double>& b, int64_t m, int64_t n,
                            int64_t k, bool trans_a, bool trans_b) {
  std::vector<double> out(static_cast<size_t>(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t p = 0; p < k; ++p)
        s += a[trans_a ? p * m + i : i * k + p] * b[trans_b ? j * k + p : p * n + j];
      out[static_cast<size_t>(i * n + j)] = s;
    }
  return out;
}

// The search's mode and TF32 for one test, restored after it.
class SearchMode {
 public:
  explicit SearchMode(bool heuristic) : heuristic_(cuda::heuristic_gemm_algos()), tf32_(cuda::allow_tf32_matmul()) {
    cuda::set_heuristic_gemm_algos(heuristic);
    cuda::set_allow_tf32_matmul(false);
  }
  ~SearchMode() {
    cuda::set_heuristic_gemm_algos(heuristic_);
    cuda::set_allow_tf32_matmul(tf32_);
  }

 private:
  bool heuristic_, tf32_;
};

struct Shape3 {
  int64_t m, n, k;
};

// A linear layer's forward (bias epilogue) and its weight gradient (bias
// gradient epilogue), and a batched plain product, all with beta == 0 into
// outputs that start as NaN.
void check_products(DType dt, Shape3 s) {
  SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " m" << s.m << " n" << s.n << " k" << s.k);
  const Device gpu("cuda:0");
  // Forward: y [m, n] = x [m, k] @ w [n, k]^T + bias [n].
  const Tensor x = randn({s.m, s.k}).to(dt), w = randn({s.n, s.k}).to(dt), bias = randn({s.n}).to(dt);
  Tensor y = full({s.m, s.n}, NAN, {dt, gpu});
  cuda::gemm_bias(x.to(gpu).contiguous(), w.to(gpu).contiguous(), y, false, true, bias.to(gpu).contiguous(), Tensor());
  std::vector<double> want = product(doubles(x), doubles(w), s.m, s.n, s.k, false, true);
  const std::vector<double> b = doubles(bias);
  for (int64_t i = 0; i < s.m; ++i)
    for (int64_t j = 0; j < s.n; ++j) want[static_cast<size_t>(i * s.n + j)] += b[static_cast<size_t>(j)];
  expect_close(doubles(y), want, tolerance(dt), "forward with the bias epilogue");

  // Weight gradient: dw [n, k] = dy [m, n]^T @ x [m, k]; db [n] = column sums of dy.
  const Tensor dy = randn({s.m, s.n}).to(dt);
  Tensor dw = full({s.n, s.k}, NAN, {dt, gpu}), db = full({s.n}, NAN, {dt, gpu});
  cuda::gemm_bias(dy.to(gpu).contiguous(), x.to(gpu).contiguous(), dw, true, false, Tensor(), db);
  expect_close(doubles(dw), product(doubles(dy), doubles(x), s.n, s.k, s.m, true, false), tolerance(dt),
               "weight gradient");
  const std::vector<double> dyv = doubles(dy);
  std::vector<double> sums(static_cast<size_t>(s.n), 0.0);
  for (int64_t i = 0; i < s.m; ++i)
    for (int64_t j = 0; j < s.n; ++j) sums[static_cast<size_t>(j)] += dyv[static_cast<size_t>(i * s.n + j)];
  expect_close(doubles(db), sums, tolerance(dt), "bias gradient (summed once, not once per timed run)");

  // Batched plain product: out [2, m, n] = a [2, m, k] @ c [2, k, n].
  const Tensor a = randn({2, s.m, s.k}).to(dt), c = randn({2, s.k, s.n}).to(dt);
  Tensor out = full({2, s.m, s.n}, NAN, {dt, gpu});
  cuda::gemm(a.to(gpu).contiguous(), c.to(gpu).contiguous(), out, false, false, 1.0, 0.0);
  const std::vector<double> av = doubles(a), cv = doubles(c);
  std::vector<double> ref;
  for (int64_t bi = 0; bi < 2; ++bi) {
    const std::vector<double> ai(av.begin() + bi * s.m * s.k, av.begin() + (bi + 1) * s.m * s.k);
    const std::vector<double> ci(cv.begin() + bi * s.k * s.n, cv.begin() + (bi + 1) * s.k * s.n);
    const std::vector<double> r = product(ai, ci, s.m, s.n, s.k, false, false);
    ref.insert(ref.end(), r.begin(), r.end());
  }
  expect_close(doubles(out), ref, tolerance(dt), "batched product");
}

TEST(GemmSearch, TimedAndHeuristicChoicesMatchFloat64_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  manual_seed(150);
  for (bool heuristic : {false, true}) {
    SearchMode mode(heuristic);
    SCOPED_TRACE(heuristic ? "heuristic" : "timed");
    for (DType dt : {kFloat32, kBFloat16})
      for (Shape3 s : {Shape3{64, 96, 128}, Shape3{37, 29, 53}, Shape3{512, 768, 256}}) check_products(dt, s);
  }
}

// out = a @ b + beta * out, checked against float64.
void check_accumulate(const Tensor& a, const Tensor& b, double beta, const char* what) {
  const Device gpu("cuda:0");
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  const Tensor before = randn({1, m, n}).to(a.dtype());
  Tensor out = before.to(gpu).contiguous();
  cuda::gemm(a.reshape({1, m, k}).to(gpu).contiguous(), b.reshape({1, k, n}).to(gpu).contiguous(), out, false, false,
             1.0, beta);
  std::vector<double> want = product(doubles(a), doubles(b), m, n, k, false, false);
  const std::vector<double> prior = doubles(before);
  for (size_t i = 0; i < want.size(); ++i) want[i] += beta * prior[i];
  expect_close(doubles(out), want, tolerance(a.dtype()), what);
}

TEST(GemmSearch, SearchesOnceForEagerOverwritingProductsAndAccumulatesAfterIt_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  manual_seed(151);
  SearchMode mode(false);
  for (DType dt : {kFloat32, kBFloat16}) {
    SCOPED_TRACE(dtype_name(dt));
    // Shapes no other test uses, so that the cache has not seen them.
    const int64_t m = dt == kFloat32 ? 71 : 73, n = 45, k = 83;
    const Tensor a = randn({m, k}).to(dt), b = randn({k, n}).to(dt);

    // First seen accumulating: the heuristic's choice, untimed.
    int64_t searches = cuda::gemm_searches_run();
    check_accumulate(a, b, 1.0, "accumulating first (untimed)");
    EXPECT_EQ(cuda::gemm_searches_run(), searches) << "a product with beta != 0 must not be timed";

    // The first overwriting call times the candidates (replacing the untimed
    // choice) ...
    check_accumulate(a, b, 0.0, "overwriting (timed)");
    EXPECT_EQ(cuda::gemm_searches_run(), searches + 1) << "the first eager beta == 0 call searches";
    // ... once: later calls of the problem reuse it.
    check_accumulate(a, b, 0.0, "overwriting again");
    EXPECT_EQ(cuda::gemm_searches_run(), searches + 1) << "a searched problem is not searched again";

    // The searched algorithm accumulates once per call: out = a @ b + out.
    check_accumulate(a, b, 1.0, "accumulating after the search");
    check_accumulate(a, b, 0.5, "accumulating with beta 0.5 after the search");
    EXPECT_EQ(cuda::gemm_searches_run(), searches + 1);
  }
}

TEST(GemmSearch, HeuristicModeNeverTimes_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  manual_seed(152);
  SearchMode mode(true);
  const Tensor a = randn({59, 91}), b = randn({91, 33});
  const int64_t searches = cuda::gemm_searches_run();
  check_accumulate(a, b, 0.0, "heuristic, overwriting");
  check_accumulate(a, b, 1.0, "heuristic, accumulating");
  EXPECT_EQ(cuda::gemm_searches_run(), searches);
}

}  // namespace
}  // namespace chorus::gemm_search_test

#endif  // CHORUS_WITH_CUDA
