// The kernel-set gemm on CUDA, through cuBLASLt.
//
// Chorus matrices are row-major; cuBLASLt's are column-major. A row-major
// [M, N] matrix is the column-major [N, M] matrix of the same bytes, so
//   out = op(a) @ op(b)   (row-major)
// is computed as
//   out^T = op(b)^T @ op(a)^T   (column-major),
// i.e. cuBLASLt's A operand is `bm`, its B operand is `a`, with the same
// transpose flags, and its problem is (m, n, k) = (N, M, K).
//
// lt::MatmulAlgoGetHeuristic costs tens of microseconds, as much as a small
// GEMM, so the algorithm chosen is cached per problem (shape, strides, dtype,
// alignment), chosen by timing the heuristic's candidates where that is
// possible (Note [Timed GEMM algorithm search] in gemm_search.h).
#include <cstdint>
#include <optional>

#include "chorus/core/error.h"
#include "chorus/cuda/blas/blas.h"
#include "chorus/cuda/blas/cublaslt_api.h"
#include "chorus/cuda/blas/gemm_search.h"
#include "chorus/cuda/runtime/caches.h"
#include "chorus/cuda/runtime/context.h"
#include "chorus/cuda/kernels/column_sums.h"
#include "chorus/cuda/kernels/kernels.h"

namespace chorus::cuda {

namespace {

cudaDataType_t cuda_dtype(DType t) {
  switch (t) {
    case kFloat32:
      return CUDA_R_32F;
    case kBFloat16:
      return CUDA_R_16BF;
    case kFloat16:
      return CUDA_R_16F;
    default:
      CHORUS_THROW(ValueError, "gemm on CUDA supports float32, bfloat16 and float16, got ",
                   dtype_name(t));
  }
}

// Largest power of two (up to 256, cuBLASLt's default requirement) dividing
// the address of every matrix of a batch.
uint32_t alignment_of(const void* p, int64_t batch_stride_bytes) {
  uint64_t bits = reinterpret_cast<uint64_t>(p) | static_cast<uint64_t>(batch_stride_bytes) | 256u;
  return static_cast<uint32_t>(bits & (~bits + 1));
}

// The cuBLASLt descriptors of one call (each Owned: cuda/runtime/caches.h).
struct LayoutDesc {
  Owned<cublasLtMatrixLayout_t, lt::MatrixLayoutDestroy> owned;
  cublasLtMatrixLayout_t d = nullptr;
  LayoutDesc(cudaDataType_t t, uint64_t rows, uint64_t cols, int64_t ld, int32_t batch,
             int64_t batch_stride) {
    CHORUS_CUBLAS_CHECK(lt::MatrixLayoutCreate(owned.out(), t, rows, cols, ld));
    d = owned.get();
    if (batch > 1) {
      CHORUS_CUBLAS_CHECK(lt::MatrixLayoutSetAttribute(d, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                           &batch, sizeof(batch)));
      CHORUS_CUBLAS_CHECK(lt::MatrixLayoutSetAttribute(
          d, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &batch_stride, sizeof(batch_stride)));
    }
  }
};

struct MatmulDesc {
  Owned<cublasLtMatmulDesc_t, lt::MatmulDescDestroy> owned;
  cublasLtMatmulDesc_t d = nullptr;
  MatmulDesc(cublasComputeType_t compute, cublasOperation_t ta, cublasOperation_t tb) {
    CHORUS_CUBLAS_CHECK(lt::MatmulDescCreate(owned.out(), compute, CUDA_R_32F));
    d = owned.get();
    CHORUS_CUBLAS_CHECK(
        lt::MatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    CHORUS_CUBLAS_CHECK(
        lt::MatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  }
};

struct PreferenceDesc {
  Owned<cublasLtMatmulPreference_t, lt::MatmulPreferenceDestroy> owned;
  cublasLtMatmulPreference_t d = nullptr;
  PreferenceDesc(uint64_t workspace, uint32_t align_a, uint32_t align_b, uint32_t align_c) {
    CHORUS_CUBLAS_CHECK(lt::MatmulPreferenceCreate(owned.out()));
    d = owned.get();
    set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof(workspace));
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof(align_a));
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof(align_b));
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof(align_c));
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c, sizeof(align_c));
  }
  void set(cublasLtMatmulPreferenceAttributes_t attr, const void* v, size_t n) {
    CHORUS_CUBLAS_CHECK(lt::MatmulPreferenceSetAttribute(d, attr, v, n));
  }
};

// Everything the heuristic's answer depends on, and the search's mode
// (Note [Timed GEMM algorithm search]).
using ProblemKey = IntKey<16>;

// algo nullopt: cuBLASLt has no algorithm for this problem (an epilogue it
// does not offer for these shapes; gemm_bias then runs the parts apart).
// final: no later call would choose differently (timed, or the heuristic's
// answer under CHORUS_GEMM_SEARCH=heuristic); an untimed choice of the search
// mode (beta != 0, a capture) is replaced by the first call that may time.
struct AlgoChoice {
  std::optional<cublasLtMatmulAlgo_t> algo;
  bool final = false;
};
using AlgoCache = LockedCache<ProblemKey, AlgoChoice>;
AlgoCache& algo_cache() {
  static auto* cache = new AlgoCache;  // leaked: used from threads that may outlive statics
  return *cache;
}

// The product through cuBLASLt with `epilogue` (CUBLASLT_EPILOGUE_DEFAULT,
// BIAS with `epilogue_vector` the bias, BGRADB with it the bias gradient);
// false, having run nothing, when cuBLASLt has no algorithm for the epilogue.
bool run_gemm(const Tensor& a, const Tensor& bm, const Tensor& out, bool trans_a, bool trans_b, double alpha,
              double beta, cublasLtEpilogue_t epilogue, void* epilogue_vector, const Tensor& aux = Tensor()) {
  CHORUS_CHECK(a.dim() == 3 && bm.dim() == 3 && out.dim() == 3,
               "gemm: expected 3-d (batch, rows, cols) operands, got a ", a.describe(), ", b ",
               bm.describe(), ", out ", out.describe());
  CHORUS_CHECK(a.is_contiguous() && bm.is_contiguous() && out.is_contiguous(),
               "gemm: operands must be contiguous, got a ", a.describe(), ", b ", bm.describe(),
               ", out ", out.describe());
  // Note [Float weight gradients from 16-bit products]: out may be float32
  // over 16-bit a and b (cuBLASLt's bf16/f16 -> float32 output form).
  CHORUS_CHECK(a.dtype() == bm.dtype() &&
                   (a.dtype() == out.dtype() ||
                    (out.dtype() == kFloat32 && (a.dtype() == kBFloat16 || a.dtype() == kFloat16))),
               "gemm: operands must share one dtype (or make a float32 out of 16-bit ones), got a ",
               a.describe(), ", b ", bm.describe(), ", out ", out.describe());
  const int64_t batch = out.size(0), m = out.size(1), n = out.size(2);
  const int64_t k = trans_a ? a.size(1) : a.size(2);
  const int64_t a_rows = trans_a ? a.size(2) : a.size(1);
  const int64_t b_rows = trans_b ? bm.size(2) : bm.size(1);
  const int64_t b_cols = trans_b ? bm.size(1) : bm.size(2);
  CHORUS_CHECK(a_rows == m && b_rows == k && b_cols == n &&
                   (a.size(0) == batch || a.size(0) == 1) &&
                   (bm.size(0) == batch || bm.size(0) == 1),
               "gemm: shapes do not match: a ", a.describe(), (trans_a ? " (transposed)" : ""),
               ", b ", bm.describe(), (trans_b ? " (transposed)" : ""), ", out ", out.describe());
  CHORUS_CHECK(batch <= INT32_MAX, "gemm: batch ", batch, " exceeds cuBLASLt's limit");
  const cudaDataType_t dt_in = cuda_dtype(a.dtype()), dt = cuda_dtype(out.dtype());
  if (batch == 0 || m == 0 || n == 0) return true;

  const int device = out.device().index;
  CudaDeviceGuard guard(device);
  cudaStream_t stream = current_stream(device);

  if (k == 0) {  // cuBLASLt rejects k == 0; out = beta * out
    if (epilogue != CUBLASLT_EPILOGUE_DEFAULT) return false;
    if (beta == 0.0) {
      CHORUS_CUDA_CHECK(cudaMemsetAsync(out.raw_data(), 0, out.nbytes(), stream));
    } else if (beta != 1.0) {
      unary(UnaryOp::MulScalar, out, out, beta);
    }
    return true;
  }

  // Column-major view (see the note at the top): A' = bm, B' = a.
  const int64_t esize_in = static_cast<int64_t>(a.element_size()), esize = static_cast<int64_t>(out.element_size());
  const int64_t lda = bm.size(2), ldb = a.size(2), ldc = n;
  const int64_t stride_a = bm.size(0) == 1 ? 0 : bm.size(1) * bm.size(2);
  const int64_t stride_b = a.size(0) == 1 ? 0 : a.size(1) * a.size(2);
  const int64_t stride_c = m * n;
  const uint32_t align_a = alignment_of(bm.raw_data(), stride_a * esize_in);
  const uint32_t align_b = alignment_of(a.raw_data(), stride_b * esize_in);
  const uint32_t align_c = alignment_of(out.raw_data(), stride_c * esize);
  const cublasComputeType_t compute = (a.dtype() == kFloat32 && allow_tf32_matmul())
                                          ? CUBLAS_COMPUTE_32F_FAST_TF32
                                          : CUBLAS_COMPUTE_32F;
  const cublasOperation_t op_a = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;

  MatmulDesc desc(compute, op_a, op_b);
  if (epilogue != CUBLASLT_EPILOGUE_DEFAULT) {
    CHORUS_CUBLAS_CHECK(lt::MatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    if (epilogue_vector)
      CHORUS_CUBLAS_CHECK(lt::MatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &epilogue_vector,
                                                     sizeof(epilogue_vector)));
    if (aux.defined()) {  // GELU's input, laid out as out (column-major: n rows, leading dimension n)
      void* aux_ptr = aux.raw_data();
      const int64_t aux_ld = n;
      CHORUS_CUBLAS_CHECK(
          lt::MatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux_ptr, sizeof(aux_ptr)));
      CHORUS_CUBLAS_CHECK(
          lt::MatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld)));
    }
  }
  // Stored column-major shapes: A' is n x k (k x n when transposed), B' is k x m (m x k).
  LayoutDesc layout_a(dt_in, trans_b ? k : n, trans_b ? n : k, lda, static_cast<int32_t>(batch),
                      stride_a);
  LayoutDesc layout_b(dt_in, trans_a ? m : k, trans_a ? k : m, ldb, static_cast<int32_t>(batch),
                      stride_b);
  LayoutDesc layout_c(dt, n, m, ldc, static_cast<int32_t>(batch), stride_c);

  const ProblemKey key{device, static_cast<int64_t>(out.dtype()) * 64 + static_cast<int64_t>(a.dtype()),
                       static_cast<int64_t>(compute),
                       trans_a, trans_b, m, n, k, batch, stride_a, stride_b, align_a, align_b,
                       align_c, static_cast<int64_t>(epilogue), heuristic_gemm_algos()};
  const MatmulCall call{cublaslt_handle(device), desc.d, bm.raw_data(), layout_a.d, a.raw_data(), layout_b.d,
                        out.raw_data(), layout_c.d, static_cast<float>(alpha), static_cast<float>(beta),
                        cublas_workspace(device, stream), stream, device};
  // Note [Timed GEMM algorithm search]: an untimed choice is replaced by the
  // first call that may time the candidates.
  const bool may_time = gemm_search_allowed(beta);
  std::optional<AlgoChoice> choice = algo_cache().find(key);
  if (!choice || (may_time && !choice->final)) {
    PreferenceDesc pref(kCublasWorkspaceBytes, align_a, align_b, align_c);
    cublasLtMatmulHeuristicResult_t results[kMaxGemmCandidates] = {};
    int found = 0;
    const cublasStatus_t st = call.candidates(pref.d, may_time ? kMaxGemmCandidates : 1, results, &found);
    if (epilogue != CUBLASLT_EPILOGUE_DEFAULT && (st != CUBLAS_STATUS_SUCCESS || found == 0)) {
      choice = AlgoChoice{std::nullopt, true};
    } else {
      CHORUS_CUBLAS_CHECK(st);
      CHORUS_CHECK_T(DeviceError, found > 0, "gemm: cuBLASLt has no algorithm for a ", a.describe(), ", b ",
                     bm.describe(), ", out ", out.describe(), " (trans_a=", trans_a, ", trans_b=", trans_b, ")");
      std::optional<cublasLtMatmulAlgo_t> fastest = may_time ? fastest_algo(call, results, found) : std::nullopt;
      choice = AlgoChoice{fastest ? *fastest : results[0].algo, may_time || heuristic_gemm_algos()};
    }
    // A timed choice replaces an untimed one; an untimed one never replaces
    // another choice (two threads may choose at once).
    if (choice->final)
      algo_cache().assign(key, *choice);
    else
      algo_cache().insert(key, *choice);
  }
  if (!choice->algo) return false;

  CHORUS_CUBLAS_CHECK(call.run(*choice->algo));
  return true;
}

Tensor as_batch(const Tensor& t) {
  return detail::make_view(t, {1, t.size(0), t.size(1)}, {t.numel(), t.stride(0), t.stride(1)}, t.storage_offset());
}

}  // namespace

void gemm(const Tensor& a, const Tensor& bm, const Tensor& out, bool trans_a, bool trans_b, double alpha,
          double beta) {
  run_gemm(a, bm, out, trans_a, trans_b, alpha, beta, CUBLASLT_EPILOGUE_DEFAULT, nullptr);
}

// Note [Linear layers' epilogues]: a linear layer's bias rides on its GEMMs,
// as llm.c's do: the forward adds it in the epilogue (no pass over the
// output to add it). The bias gradient of a weight gradient dW = dY^T X
// (trans_a) is dY's column sums, from Chorus's own kernel (Note [Bias
// gradients as column sums] in cuda/kernels/column_sums.cu): cuBLASLt's
// BGRADB epilogue ran as a separate, slower kernel anyway. Other bias
// gradients take BGRADB (in its column-major view B' is a and the sums run
// over the product's k). Where cuBLASLt offers no algorithm with an epilogue
// (float32 on some GPUs, shapes), the parts run apart with the same results.
void gemm_bias(const Tensor& a, const Tensor& bm, const Tensor& out, bool trans_a, bool trans_b, const Tensor& bias,
               const Tensor& bias_grad) {
  CHORUS_CHECK(a.dim() == 2 && bm.dim() == 2 && out.dim() == 2, "gemm_bias: expected 2-d operands, got a ",
               a.describe(), ", b ", bm.describe(), ", out ", out.describe());
  CHORUS_CHECK(!(bias.defined() && bias_grad.defined()), "gemm_bias: a bias or a bias gradient, not both");
  CHORUS_CHECK(!bias.defined() || out.dtype() == a.dtype(), "gemm_bias: a bias epilogue needs out in a's dtype ",
               dtype_name(a.dtype()), ", got out ", out.describe());
  const Tensor& vec = bias.defined() ? bias : bias_grad;
  if (vec.defined())
    CHORUS_CHECK(vec.is_contiguous() && vec.dtype() == out.dtype() &&
                     vec.numel() == (bias.defined() ? out.size(1) : out.size(0)),
                 "gemm_bias: the bias vector ", vec.describe(), " does not fit out ", out.describe());
  if (bias_grad.defined() && trans_a) {
    run_gemm(as_batch(a), as_batch(bm), as_batch(out), trans_a, trans_b, 1.0, 0.0, CUBLASLT_EPILOGUE_DEFAULT, nullptr);
    column_sums(a, bias_grad);
    return;
  }
  // In cuBLASLt's column-major view (top of this file) out's columns are the
  // rows of its D (BIAS: one value per row of D) and out's rows its columns
  // (BGRADB: one per column of D, summed over B' = a).
  const cublasLtEpilogue_t epi =
      bias.defined() ? CUBLASLT_EPILOGUE_BIAS : bias_grad.defined() ? CUBLASLT_EPILOGUE_BGRADB : CUBLASLT_EPILOGUE_DEFAULT;
  if (run_gemm(as_batch(a), as_batch(bm), as_batch(out), trans_a, trans_b, 1.0, 0.0, epi,
                        vec.defined() ? vec.raw_data() : nullptr))
    return;
  run_gemm(as_batch(a), as_batch(bm), as_batch(out), trans_a, trans_b, 1.0, 0.0, CUBLASLT_EPILOGUE_DEFAULT, nullptr);
  const int64_t m = out.size(0), n = out.size(1);
  if (bias.defined())
    binary(BinaryOp::Add, out, detail::make_view(bias, {m, n}, {0, 1}, bias.storage_offset()), out, 1.0);
  if (bias_grad.defined()) {
    const Tensor opa =
        trans_a ? detail::make_view(a, {a.size(1), a.size(0)}, {a.stride(1), a.stride(0)}, a.storage_offset()) : a;
    // The sums keep a's dtype (reduce's contract); a float32 bias gradient of
    // 16-bit data takes them converted.
    const Tensor sums = bias_grad.dtype() == a.dtype() ? bias_grad : detail::empty_tensor({m}, a.dtype(), a.device());
    reduce(ReduceOp::Sum, opa, detail::make_view(sums, {m, 1}, {1, 1}, sums.storage_offset()), {false, true});
    if (sums.dtype() != bias_grad.dtype()) copy(sums, bias_grad);
  }
}

// Note [Float weight gradients from 16-bit products]: under autocast a
// float32 parameter's linear layer (and GPT MLP) computes with the parameter's
// 16-bit copy but records the parameter itself (autograd::linear_bias's
// weight_data), and its weight gradient dW = dY^T X is asked for in float32:
// cuBLASLt reads the bf16 dY and X, accumulates in float32 as always, and
// writes float32 -- the bias gradient, Chorus's column sums, in float32 too
// (Note [Bias gradients as column sums]) -- where the product used to round
// dW to bf16 and a recorded cast's backward (one more kernel a parameter)
// widened it again; the tied classifier's [50304, 768] gradient, transposed,
// took a strided cast of 0.29 ms a gpt2 step on an H200 (benchmarks journal,
// session 40). The gradient keeps float32 accumulation's bits.
//
// Note [GELU in the MLP's epilogues]: GELU_AUX_BIAS writes the MLP's hidden
// activation and, beside it, its input (the aux, kept for the backward), from
// the product's own kernel; cuBLASLt's GELU is the tanh form, GPT-2's. The
// backward's DGELU epilogue is not used: on an H100 (CUDA 13) cuBLASLt runs it
// as a separate kernel after the product, 0.55 ms for gpt2-xl's [8192, 6400]
// against ~0.1 ms for the elementwise kernel that replaces it (benchmarks
// journal, session 32); the first bias's gradient is summed by that
// elementwise pass (Note [GELU's gradient with the bias gradient] in
// cuda/kernels/column_sums.cu).
void gemm_bias_gelu(const Tensor& a, const Tensor& bm, const Tensor& bias, const Tensor& pre, const Tensor& out) {
  CHORUS_CHECK(a.dim() == 2 && bm.dim() == 2 && out.dim() == 2 && pre.sizes() == out.sizes() &&
                   pre.dtype() == out.dtype() && pre.is_contiguous() && bias.is_contiguous() &&
                   bias.dtype() == out.dtype() && bias.numel() == out.size(1),
               "gemm_bias_gelu: operands do not fit: a ", a.describe(), ", b ", bm.describe(), ", bias ",
               bias.describe(), ", pre ", pre.describe(), ", out ", out.describe());
  if (run_gemm(as_batch(a), as_batch(bm), as_batch(out), false, true, 1.0, 0.0, CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
               bias.raw_data(), pre))
    return;
  gemm_bias(a, bm, pre, false, true, bias, Tensor());
  unary(UnaryOp::GeluTanh, pre, out, 0.0);
}

void gemm_dgelu(const Tensor& a, const Tensor& bm, const Tensor& pre, const Tensor& out, const Tensor& bias_grad) {
  CHORUS_CHECK(a.dim() == 2 && bm.dim() == 2 && out.dim() == 2 && pre.sizes() == out.sizes() &&
                   pre.dtype() == out.dtype() && pre.is_contiguous() &&
                   (!bias_grad.defined() ||
                    (bias_grad.is_contiguous() && (bias_grad.dtype() == out.dtype() || bias_grad.dtype() == kFloat32) &&
                     bias_grad.numel() == out.size(1))),
               "gemm_dgelu: operands do not fit: a ", a.describe(), ", b ", bm.describe(), ", pre ", pre.describe(),
               ", out ", out.describe(), ", bias_grad ", bias_grad.describe());
  run_gemm(as_batch(a), as_batch(bm), as_batch(out), false, false, 1.0, 0.0, CUBLASLT_EPILOGUE_DEFAULT, nullptr);
  if (bias_grad.defined()) {
    gelu_tanh_grad_colsum(out, pre, bias_grad);  // Note [GELU's gradient with the bias gradient]
  } else {
    binary(BinaryOp::GeluTanhGrad, out, pre, out, 1.0);
  }
}

}  // namespace chorus::cuda
