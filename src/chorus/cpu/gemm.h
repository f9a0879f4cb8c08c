// Single-precision GEMM on host memory, row-major, through OpenBLAS.
//
// This is the one place the CPU kernels call BLAS, so that the int64 -> int
// narrowing, the argument checks and the k == 0 corner live in one spot.
// Threading is OpenBLAS's own (its pthread pool); callers do not add threads
// around it.
#pragma once

#include <cstdint>

namespace chorus::cpu {

// C[m, n] = alpha * op(A)[m, k] * op(B)[k, n] + beta * C, all row-major.
// op(A) is A[m, k] (lda >= k) or, with trans_a, A[k, m] transposed (lda >= m);
// likewise for B. With beta == 0, C is not read (NaNs in it do not leak).
// Throws std::invalid_argument on negative sizes, too-small leading
// dimensions, or sizes past OpenBLAS's 32-bit int.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
          const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
          int64_t ldc);

// `batch` independent GEMMs; matrix i uses a + i * stride_a, b + i * stride_b,
// c + i * stride_c. A stride of 0 reuses one operand for every batch entry
// (stride_c must not be 0 when batch > 1, the outputs would overlap).
void gemm_batched(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                  const float* a, int64_t lda, int64_t stride_a, const float* b, int64_t ldb,
                  int64_t stride_b, float beta, float* c, int64_t ldc, int64_t stride_c,
                  int64_t batch);

}  // namespace chorus::cpu
