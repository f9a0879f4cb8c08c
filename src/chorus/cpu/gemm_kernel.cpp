// The kernel-set gemm on the CPU: batched float32 through OpenBLAS; bf16/f16
// operands are widened to float32 first.
#include <cblas.h>

#include "chorus/cpu/dtype_dispatch.h"
#include "chorus/cpu/kernels.h"

namespace chorus::cpu {

namespace {
Tensor as_float(const Tensor& t) {
  if (t.dtype() == kFloat32) return t;
  Tensor f = detail::empty_tensor(t.sizes(), kFloat32, t.device());
  copy(t, f);
  return f;
}
}  // namespace

void gemm(const Tensor& a, const Tensor& bm, const Tensor& out, bool trans_a, bool trans_b,
          double alpha, double beta) {
  if (a.dtype() == kFloat64) {  // gradient checks
    const int64_t batch = a.size(0), m = out.size(1), n = out.size(2);
    const int64_t k = trans_a ? a.size(1) : a.size(2);
    for (int64_t i = 0; i < batch; ++i)
      cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                  static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha,
                  a.data<double>() + i * a.size(1) * a.size(2), static_cast<int>(a.size(2)),
                  bm.data<double>() + i * bm.size(1) * bm.size(2), static_cast<int>(bm.size(2)), beta,
                  out.data<double>() + i * m * n, static_cast<int>(n));
    return;
  }
  Tensor fa = as_float(a), fb = as_float(bm);
  Tensor fo = out.dtype() == kFloat32 ? out : as_float(out);
  const int64_t batch = fa.size(0);
  const int64_t m = fo.size(1), n = fo.size(2);
  const int64_t k = trans_a ? fa.size(1) : fa.size(2);
  const int64_t lda = fa.size(2), ldb = fb.size(2), ldc = n;
  const float* pa = fa.data<float>();
  const float* pb = fb.data<float>();
  float* pc = fo.data<float>();
  for (int64_t i = 0; i < batch; ++i) {
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), static_cast<float>(alpha),
                pa + i * fa.size(1) * fa.size(2), static_cast<int>(lda),
                pb + i * fb.size(1) * fb.size(2), static_cast<int>(ldb), static_cast<float>(beta),
                pc + i * m * n, static_cast<int>(ldc));
  }
  if (!fo.is_same(out)) copy(fo, out);
}

namespace {
Tensor as_batch(const Tensor& t) { return detail::make_view(t, {1, t.size(0), t.size(1)}, {t.numel(), t.stride(0), t.stride(1)}, t.storage_offset()); }
}  // namespace

// The product, then the bias (broadcast over rows) and the row sums of op(a)
// through the kernel set's own add and sum: the CPU has no epilogue to fuse.
void gemm_bias(const Tensor& a, const Tensor& bm, const Tensor& out, bool trans_a, bool trans_b, const Tensor& bias,
               const Tensor& bias_grad) {
  if (out.dtype() != a.dtype()) {  // a float32 weight gradient of 16-bit data: the operands widened, exactly
    CHORUS_CHECK(!bias.defined() && (!bias_grad.defined() || bias_grad.dtype() == out.dtype()),
                 "gemm_bias: out ", out.describe(), " in another dtype than a ", a.describe(),
                 " takes no bias and a bias gradient of out's dtype");
    const Tensor aw = detail::empty_tensor(a.sizes(), out.dtype(), a.device());
    const Tensor bw = detail::empty_tensor(bm.sizes(), out.dtype(), bm.device());
    copy(a, aw);
    copy(bm, bw);
    gemm_bias(aw, bw, out, trans_a, trans_b, Tensor(), bias_grad);
    return;
  }
  gemm(as_batch(a), as_batch(bm), as_batch(out), trans_a, trans_b, 1.0, 0.0);
  const int64_t m = out.size(0), n = out.size(1);
  if (bias.defined()) binary(BinaryOp::Add, out, detail::make_view(bias, {m, n}, {0, bias.stride(0)}, bias.storage_offset()), out, 1.0);
  if (bias_grad.defined()) {
    // op(a) is [m, k]: a itself, or a transposed view of a [k, m].
    const Tensor opa = trans_a ? detail::make_view(a, {a.size(1), a.size(0)}, {a.stride(1), a.stride(0)}, a.storage_offset()) : a;
    reduce(ReduceOp::Sum, opa, detail::make_view(bias_grad, {m, 1}, {bias_grad.stride(0), 1}, bias_grad.storage_offset()),
           {false, true});
  }
}

void gemm_bias_gelu(const Tensor& a, const Tensor& bm, const Tensor& bias, const Tensor& pre, const Tensor& out) {
  gemm_bias(a, bm, pre, false, true, bias, Tensor());
  unary(UnaryOp::GeluTanh, pre, out, 0.0);
}

void gemm_dgelu(const Tensor& a, const Tensor& bm, const Tensor& pre, const Tensor& out, const Tensor& bias_grad) {
  gemm(as_batch(a), as_batch(bm), as_batch(out), false, false, 1.0, 0.0);
  binary(BinaryOp::GeluTanhGrad, out, pre, out, 1.0);
  if (bias_grad.defined()) {
    const int64_t n = out.size(1);
    // A float32 bias gradient of 16-bit out sums out widened (exactly).
    Tensor summed = out;
    if (bias_grad.dtype() != out.dtype()) {
      summed = detail::empty_tensor(out.sizes(), bias_grad.dtype(), out.device());
      copy(out, summed);
    }
    reduce(ReduceOp::Sum, detail::make_view(summed, {n, out.size(0)}, {1, n}, summed.storage_offset()),
           detail::make_view(bias_grad, {n, 1}, {1, 1}, bias_grad.storage_offset()), {false, true});
  }
}

}  // namespace chorus::cpu
