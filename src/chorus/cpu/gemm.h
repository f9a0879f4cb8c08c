// Single-precision GEMM on host memory, row-major, through OpenBLAS.
//
// The int64 -> int narrowing, the argument checks and the k == 0 corner live
// here. A single call is threaded by OpenBLAS's own pool; kernels that split
// their work over the Chorus CPU pool instead (conv2d, over images) hold a
// SerialBlasScope so the two pools do not fight over the cores.
#pragma once

#include <cstdint>

namespace chorus::cpu {

// C[m, n] = alpha * op(A)[m, k] * op(B)[k, n] + beta * C, all row-major.
// op(A) is A[m, k] (lda >= k) or, with trans_a, A[k, m] transposed (lda >= m);
// likewise for B. With beta == 0, C is not read (NaNs in it do not leak).
// Throws std::invalid_argument on negative sizes, too-small leading
// dimensions, or sizes past OpenBLAS's 32-bit int.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// `batch` independent GEMMs; matrix i uses a + i * stride_a, b + i * stride_b,
// c + i * stride_c. A stride of 0 reuses one operand for every batch entry
// (stride_c must not be 0 when batch > 1, the outputs would overlap).
void gemm_batched(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                  const float* a, int64_t lda, int64_t stride_a, const float* b, int64_t ldb,
                  int64_t stride_b, float beta, float* c, int64_t ldc, int64_t stride_c,
                  int64_t batch);

// While alive, OpenBLAS runs every call on the calling thread. For kernels
// that already run several BLAS calls at once on the CPU pool: on CNN layers,
// two threads each running single-threaded GEMMs (and their im2col copies)
// beat one OpenBLAS-threaded GEMM at a time by 1.2-2x (bench/cpu_kernels).
// OpenBLAS's thread count is process-global, so scopes are reference
// counted across threads: the first sets 1, the last restores the previous
// count. BLAS calls elsewhere in the process meanwhile also run on one
// thread: slower, never wrong.
class SerialBlasScope {
 public:
  SerialBlasScope();
  ~SerialBlasScope();
  SerialBlasScope(const SerialBlasScope&) = delete;
  SerialBlasScope& operator=(const SerialBlasScope&) = delete;
};

}  // namespace chorus::cpu
