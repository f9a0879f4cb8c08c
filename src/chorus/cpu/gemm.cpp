// See gemm.h. A thin, checked wrapper over cblas_sgemm.
#include "chorus/cpu/gemm.h"

#include <cblas.h>

#include <algorithm>
#include <climits>
#include <mutex>
#include <stdexcept>
#include <string>

namespace chorus::cpu {
namespace {

std::string dims(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, int64_t lda,
                 int64_t ldb, int64_t ldc) {
  return "(trans_a=" + std::to_string(trans_a) + ", trans_b=" + std::to_string(trans_b) +
         ", m=" + std::to_string(m) + ", n=" + std::to_string(n) + ", k=" + std::to_string(k) +
         ", lda=" + std::to_string(lda) + ", ldb=" + std::to_string(ldb) +
         ", ldc=" + std::to_string(ldc) + ")";
}

void check_gemm(const char* name, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                int64_t lda, int64_t ldb, int64_t ldc) {
  auto fail = [&](const std::string& why) {
    throw std::invalid_argument(std::string(name) + ": " + why + " " +
                                dims(trans_a, trans_b, m, n, k, lda, ldb, ldc));
  };
  if (m < 0 || n < 0 || k < 0) fail("negative size");
  // Row-major leading dimensions are row lengths; BLAS wants them >= 1 even
  // for empty matrices.
  const int64_t need_lda = std::max<int64_t>(1, trans_a ? m : k);
  const int64_t need_ldb = std::max<int64_t>(1, trans_b ? k : n);
  const int64_t need_ldc = std::max<int64_t>(1, n);
  if (lda < need_lda) fail("lda must be >= " + std::to_string(need_lda));
  if (ldb < need_ldb) fail("ldb must be >= " + std::to_string(need_ldb));
  if (ldc < need_ldc) fail("ldc must be >= " + std::to_string(need_ldc));
  // The OpenBLAS build on the path uses 32-bit blasint.
  for (int64_t v : {m, n, k, lda, ldb, ldc}) {
    if (v > INT_MAX) fail("size exceeds OpenBLAS's 32-bit index");
  }
}

// SerialBlasScope's shared state: how many scopes are alive, and the thread
// count to restore when the last one ends.
struct SerialState {
  std::mutex mu;
  int depth = 0;
  int saved_threads = 1;
};
SerialState& serial_state() {
  static SerialState state;
  return state;
}

// C = beta * C for the k == 0 case, where BLAS implementations differ.
void scale_c(int64_t m, int64_t n, float beta, float* c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i) {
    float* row = c + i * ldc;
    if (beta == 0.0f) {
      std::fill(row, row + n, 0.0f);
    } else if (beta != 1.0f) {
      for (int64_t j = 0; j < n; ++j) row[j] *= beta;
    }
  }
}

void gemm_unchecked(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                    const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                    int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0 || alpha == 0.0f) {
    scale_c(m, n, beta, c, ldc);
    return;
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
              static_cast<int>(k), alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb), beta,
              c, static_cast<int>(ldc));
}

}  // namespace

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  check_gemm("gemm", trans_a, trans_b, m, n, k, lda, ldb, ldc);
  gemm_unchecked(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void gemm_batched(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                  const float* a, int64_t lda, int64_t stride_a, const float* b, int64_t ldb,
                  int64_t stride_b, float beta, float* c, int64_t ldc, int64_t stride_c,
                  int64_t batch) {
  check_gemm("gemm_batched", trans_a, trans_b, m, n, k, lda, ldb, ldc);
  if (batch < 0 || stride_a < 0 || stride_b < 0 || stride_c < 0) {
    throw std::invalid_argument(
        "gemm_batched: negative batch or stride (batch=" + std::to_string(batch) +
        ", stride_a=" + std::to_string(stride_a) + ", stride_b=" + std::to_string(stride_b) +
        ", stride_c=" + std::to_string(stride_c) + ")");
  }
  if (batch > 1 && m > 0 && n > 0 && stride_c == 0) {
    throw std::invalid_argument("gemm_batched: stride_c=0 with batch=" + std::to_string(batch) +
                                " would write every product to the same C");
  }
  // One BLAS call per entry (OpenBLAS 0.3.21 has no batched sgemm); each
  // call is threaded by OpenBLAS unless a SerialBlasScope is alive.
  for (int64_t i = 0; i < batch; ++i) {
    gemm_unchecked(trans_a, trans_b, m, n, k, alpha, a + i * stride_a, lda, b + i * stride_b, ldb,
                   beta, c + i * stride_c, ldc);
  }
}

SerialBlasScope::SerialBlasScope() {
  SerialState& st = serial_state();
  std::lock_guard<std::mutex> lock(st.mu);
  if (st.depth++ == 0) {
    st.saved_threads = openblas_get_num_threads();
    if (st.saved_threads != 1) openblas_set_num_threads(1);
  }
}

SerialBlasScope::~SerialBlasScope() {
  SerialState& st = serial_state();
  std::lock_guard<std::mutex> lock(st.mu);
  if (--st.depth == 0 && st.saved_threads != 1) openblas_set_num_threads(st.saved_threads);
}

}  // namespace chorus::cpu
