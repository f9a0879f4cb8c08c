#include "chorus/ops/transformer.h"

#include "chorus/core/error.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/dispatch.h"
#include "chorus/ops/elementwise.h"
#include "chorus/ops/nn.h"
#include "chorus/ops/views.h"

namespace chorus::ops {

namespace {

// The layer norm's parameter on x's device, contiguous; its dtype x's or float32.
Tensor norm_param(const Tensor& p, const Tensor& x, const char* arg) {
  if (!p.defined()) return p;
  CHORUS_CHECK(p.dim() == 1 && p.size(0) == x.size(-1), "layer_norm: ", arg, " ", p.describe(), " must be [",
               x.size(-1), "] for input ", shape_str(x.sizes()));
  CHORUS_CHECK(p.dtype() == x.dtype() || p.dtype() == kFloat32, "layer_norm: ", arg, " ", p.describe(),
               " must be float32 or the input's dtype ", dtype_name(x.dtype()));
  return contiguous(to_device(p, x.device()));
}

DType stats_dtype(const Tensor& x) { return x.dtype() == kFloat64 ? kFloat64 : kFloat32; }

// [B, H, T, D] as a contiguous [B*H, T, D].
Tensor heads_batch(const Tensor& t) {
  return view(contiguous(t), {t.size(0) * t.size(1), t.size(2), t.size(3)});
}

Tensor gemm3(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  const int64_t rows = ta ? a.size(2) : a.size(1), cols = tb ? b.size(1) : b.size(2);
  Tensor out = detail::empty_tensor({a.size(0), rows, cols}, a.dtype(), a.device());
  if (out.numel()) CHORUS_KERNEL(a.device(), gemm, a, b, out, ta, tb, 1.0, 0.0);
  return out;
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps) {
  detail::check_defined(x, "layer_norm", "input");
  CHORUS_CHECK(is_floating(x.dtype()) && x.dim() >= 1, "layer_norm: expected a floating tensor of at least one dim, got ",
               x.describe());
  CHORUS_CHECK(eps > 0, "layer_norm: eps must be positive, got ", eps);
  Tensor xc = contiguous(x);
  Tensor g = norm_param(gamma, xc, "weight"), b = norm_param(beta, xc, "bias");
  const int64_t rows = xc.size(-1) ? xc.numel() / xc.size(-1) : 0;
  Tensor y = detail::empty_tensor(xc.sizes(), xc.dtype(), xc.device());
  Tensor mean = detail::empty_tensor({rows}, stats_dtype(xc), xc.device());
  Tensor rstd = detail::empty_tensor({rows}, stats_dtype(xc), xc.device());
  if (y.numel()) CHORUS_KERNEL(xc.device(), layer_norm_forward, xc, g, b, eps, y, mean, rstd);
  return {y, mean, rstd};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> add_layer_norm(const Tensor& x, const Tensor& r, const Tensor& gamma,
                                                          const Tensor& beta, double eps) {
  detail::check_defined(x, "add_layer_norm", "input");
  detail::check_defined(r, "add_layer_norm", "residual branch");
  CHORUS_CHECK(is_floating(x.dtype()) && x.dim() >= 1,
               "add_layer_norm: expected a floating tensor of at least one dim, got ", x.describe());
  CHORUS_CHECK(r.sizes() == x.sizes() && r.dtype() == x.dtype() && r.device() == x.device(),
               "add_layer_norm: the two addends must share shape, dtype and device, got ", x.describe(), " and ",
               r.describe());
  CHORUS_CHECK(eps > 0, "add_layer_norm: eps must be positive, got ", eps);
  Tensor xc = contiguous(x), rc = contiguous(r);
  Tensor g = norm_param(gamma, xc, "weight"), b = norm_param(beta, xc, "bias");
  const int64_t rows = xc.size(-1) ? xc.numel() / xc.size(-1) : 0;
  Tensor sum = detail::empty_tensor(xc.sizes(), xc.dtype(), xc.device());
  Tensor y = detail::empty_tensor(xc.sizes(), xc.dtype(), xc.device());
  Tensor mean = detail::empty_tensor({rows}, stats_dtype(xc), xc.device());
  Tensor rstd = detail::empty_tensor({rows}, stats_dtype(xc), xc.device());
  if (y.numel()) CHORUS_KERNEL(xc.device(), add_layer_norm_forward, xc, rc, g, b, eps, sum, y, mean, rstd);
  return {sum, y, mean, rstd};
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                                       const Tensor& mean, const Tensor& rstd, bool need_dgamma,
                                                       bool need_dbeta, const Tensor& dresidual) {
  Tensor xc = contiguous(x);
  Tensor dyc = contiguous(to_dtype(to_device(dy, xc.device()), xc.dtype()));
  Tensor dres = dresidual.defined() ? contiguous(to_dtype(to_device(dresidual, xc.device()), xc.dtype())) : Tensor();
  CHORUS_CHECK(!dres.defined() || dres.sizes() == xc.sizes(), "layer_norm_backward: the residual gradient ",
               dres.describe(), " must have the input's shape ", shape_str(xc.sizes()));
  Tensor g = norm_param(gamma, xc, "weight");
  const Device dev = xc.device();
  const int64_t cols = xc.size(-1);
  // CUDA sums the parameter gradients in float32 (cuda/kernels/layer_norm_backward.cu); the CPU
  // writes them in the parameter's dtype.
  const DType pdt = gamma.defined() ? gamma.dtype() : xc.dtype();
  const DType sum_dt = dev.is_cuda() ? kFloat32 : pdt;
  Tensor dx = detail::empty_tensor(xc.sizes(), xc.dtype(), dev);
  Tensor dg = need_dgamma ? detail::empty_tensor({cols}, sum_dt, dev) : Tensor();
  Tensor db = need_dbeta ? detail::empty_tensor({cols}, sum_dt, dev) : Tensor();
  CHORUS_KERNEL(dev, layer_norm_backward, dyc, xc, g, mean, rstd, dres, dx, dg, db);
  if (dg.defined() && dg.dtype() != pdt) dg = to_dtype(dg, pdt);
  if (db.defined() && db.dtype() != pdt) db = to_dtype(db, pdt);
  return {dx, dg, db};
}

const char* attention_kernel_name(AttentionKernel k) {
  switch (k) {
    case AttentionKernel::Auto: return "auto";
    case AttentionKernel::Fused: return "fused";
    case AttentionKernel::Composite: return "composite";
  }
  return "?";
}

AttentionKernel parse_attention_kernel(const std::string& name) {
  for (AttentionKernel k : {AttentionKernel::Auto, AttentionKernel::Fused, AttentionKernel::Composite})
    if (name == attention_kernel_name(k)) return k;
  CHORUS_THROW(ValueError, "unknown attention kernel '", name, "' (expected auto, fused or composite)");
}

namespace {

// Why the fused kernel cannot take this call ("" when it may try).
std::string fused_refusal(const Tensor& q, const Tensor& k, bool causal, double dropout) {
  if (!q.device().is_cuda()) return "the fused attention kernel runs on CUDA devices only";
  if (q.dtype() != kBFloat16 && q.dtype() != kFloat16)
    return "the fused attention kernel takes bfloat16 or float16, got " + std::string(dtype_name(q.dtype()));
  if (dropout > 0) return "the fused attention kernel has no dropout on the probabilities";
  if (q.size(3) % 8 != 0 || q.size(3) > 128)
    return "the fused attention kernel takes head_dim a multiple of 8 up to 128, got " + std::to_string(q.size(3));
  if (causal && q.size(2) != k.size(2)) return "the fused attention kernel's causal mask needs as many keys as queries";
  return "";
}

// An uninitialised [B, H, T, D] view of a [B, T, H, D] tensor: the layout the
// heads merge back from for free.
Tensor heads_last_empty(const Tensor& like) {
  Tensor t = detail::empty_tensor({like.size(0), like.size(2), like.size(1), like.size(3)}, like.dtype(), like.device());
  return permute(t, {0, 2, 1, 3});
}

// Whether x [B, H, T, D] is laid out as heads_last_empty makes it.
bool is_heads_last(const Tensor& x) {
  const int64_t h = x.size(1), t = x.size(2), d = x.size(3);
  return x.stride(3) == 1 && x.stride(1) == d && x.stride(2) == h * d && x.stride(0) == t * h * d;
}

}  // namespace

AttentionSaved attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale, double dropout,
                         AttentionKernel kernel) {
  for (const Tensor* t : {&q, &k, &v}) detail::check_defined(*t, "attention", "q/k/v");
  CHORUS_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attention: q, k, v must be [batch, heads, seq, head_dim], got ",
               q.describe(), ", ", k.describe(), ", ", v.describe());
  CHORUS_CHECK(k.sizes() == v.sizes() && q.size(0) == k.size(0) && q.size(1) == k.size(1) && q.size(3) == k.size(3),
               "attention: k and v ", shape_str(k.sizes()), ", ", shape_str(v.sizes()), " do not match q ",
               shape_str(q.sizes()));
  CHORUS_CHECK(q.dtype() == k.dtype() && q.dtype() == v.dtype() && is_floating(q.dtype()),
               "attention: q, k, v must share one floating dtype, got ", q.describe(), ", ", k.describe(), ", ",
               v.describe());
  CHORUS_CHECK(q.device() == k.device() && q.device() == v.device(), "attention: q, k, v must be on one device, got ",
               q.describe(), ", ", k.describe(), ", ", v.describe());
  CHORUS_CHECK(dropout >= 0 && dropout < 1, "attention: dropout must be in [0, 1), got ", dropout);
  CHORUS_CHECK(!causal || k.size(2) >= q.size(2), "attention: a causal mask needs at least as many keys (",
               k.size(2), ") as queries (", q.size(2), ")");
  if (kernel != AttentionKernel::Composite) {
    std::string why = fused_refusal(q, k, causal, dropout);
    if (why.empty()) {
      AttentionSaved s;
      s.out = heads_last_empty(q);
      s.stats = detail::empty_tensor({q.size(0), q.size(1), q.size(2)}, kFloat32, q.device());
      s.fused = CHORUS_KERNEL(q.device(), attention_fused_forward, q, k, v, scale, causal, s.out, s.stats);
      if (s.fused) return s;
      why = "cuDNN has no fused attention for q " + q.describe() + ", k " + k.describe() + ", v " + v.describe();
#if CHORUS_WITH_CUDA
      const std::string detail = cuda::fused_attention_refusal();
      if (!detail.empty()) why += " (" + detail + ")";
#endif
    }
    CHORUS_CHECK(kernel != AttentionKernel::Fused, "attention: ", why);
  }
  Tensor q3 = heads_batch(q), k3 = heads_batch(k), v3 = heads_batch(v);
  Tensor scores = gemm3(q3, k3, false, true);  // [BH, T, S]
  AttentionSaved s;
  s.probs = detail::empty_tensor(scores.sizes(), scores.dtype(), scores.device());
  if (s.probs.numel()) CHORUS_KERNEL(q.device(), attention_softmax_forward, scores, scale, causal, s.probs);
  Tensor used = s.probs;
  if (dropout > 0) {
    s.mask = dropout_mask(s.probs.sizes(), s.probs.dtype(), s.probs.device(), dropout);
    used = binary(BinaryOp::Mul, s.probs, s.mask);
  }
  s.out = view(gemm3(used, v3, false, false), q.sizes());  // [BH, T, D]
  return s;
}

namespace {
// The composite path's gradients (attention's two products, backwards).
std::tuple<Tensor, Tensor, Tensor> composite_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                                const Tensor& v, const AttentionSaved& saved,
                                                                bool causal, double scale);
}  // namespace

std::tuple<Tensor, Tensor, Tensor> attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                      const Tensor& v, const AttentionSaved& saved, bool causal,
                                                      double scale) {
  if (saved.fused) {
    Tensor dq = heads_last_empty(q), dk = heads_last_empty(k), dv = heads_last_empty(v);
    attention_backward_into(dout, q, k, v, saved, causal, scale, dq, dk, dv);
    return {dq, dk, dv};
  }
  return composite_attention_backward(dout, q, k, v, saved, causal, scale);
}

void attention_backward_into(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                             const AttentionSaved& saved, bool causal, double scale, const Tensor& dq,
                             const Tensor& dk, const Tensor& dv) {
  CHORUS_CHECK(dq.sizes() == q.sizes() && dk.sizes() == k.sizes() && dv.sizes() == v.sizes() &&
                   dq.dtype() == q.dtype() && dk.dtype() == k.dtype() && dv.dtype() == v.dtype(),
               "attention_backward_into: dq, dk, dv must match q, k, v in shape and dtype");
  if (saved.fused) {
    Tensor g = to_dtype(to_device(dout, q.device()), q.dtype());
    if (g.stride(3) != 1) g = contiguous(g);
    bool ran = CHORUS_KERNEL(q.device(), attention_fused_backward, g, q, k, v, saved.out, saved.stats, scale, causal,
                             dq, dk, dv);
    if (!ran && g.is_contiguous() == false) {  // an odd gradient layout: try the packed one
      g = contiguous(g);
      ran = CHORUS_KERNEL(q.device(), attention_fused_backward, g, q, k, v, saved.out, saved.stats, scale, causal, dq,
                          dk, dv);
    }
    if (!ran && !(is_heads_last(dq) && is_heads_last(dk) && is_heads_last(dv))) {
      // Destinations of a layout cuDNN would not write: its own layout, then a copy.
      Tensor tq = heads_last_empty(q), tk = heads_last_empty(k), tv = heads_last_empty(v);
      ran = CHORUS_KERNEL(q.device(), attention_fused_backward, g, q, k, v, saved.out, saved.stats, scale, causal, tq,
                          tk, tv);
      if (ran) {
        copy_(dq, tq);
        copy_(dk, tk);
        copy_(dv, tv);
      }
    }
    CHORUS_CHECK(ran, "attention: cuDNN took the fused forward of q ", q.describe(), " but not its backward",
#if CHORUS_WITH_CUDA
                 " (", cuda::fused_attention_refusal(), ")"
#else
                 ""
#endif
    );
    return;
  }
  auto [gq, gk, gv] = composite_attention_backward(dout, q, k, v, saved, causal, scale);
  copy_(dq, gq);
  copy_(dk, gk);
  copy_(dv, gv);
}

namespace {

std::tuple<Tensor, Tensor, Tensor> composite_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                                const Tensor& v, const AttentionSaved& saved,
                                                                bool causal, double scale) {
  const Tensor& probs = saved.probs;
  const Tensor& mask = saved.mask;
  Tensor q3 = heads_batch(q), k3 = heads_batch(k), v3 = heads_batch(v);
  Tensor do3 = heads_batch(to_dtype(to_device(dout, q.device()), q.dtype()));
  const Tensor used = mask.defined() ? binary(BinaryOp::Mul, probs, mask) : probs;
  Tensor dv = gemm3(used, do3, true, false);      // P^T dO   [BH, S, D]
  Tensor dp = gemm3(do3, v3, false, true);        // dO V^T   [BH, T, S]
  if (mask.defined()) dp = binary(BinaryOp::Mul, dp, mask);
  Tensor ds = detail::empty_tensor(dp.sizes(), dp.dtype(), dp.device());
  if (ds.numel()) CHORUS_KERNEL(q.device(), attention_softmax_backward, dp, probs, scale, causal, ds);
  Tensor dq = gemm3(ds, k3, false, false);        // dS K     [BH, T, D]
  Tensor dk = gemm3(ds, q3, true, false);         // dS^T Q   [BH, S, D]
  return {view(dq, q.sizes()), view(dk, k.sizes()), view(dv, v.sizes())};
}

}  // namespace

std::pair<Tensor, Tensor> cross_entropy_fused(const Tensor& logits, const Tensor& target, int64_t valid_cols,
                                              int64_t ignore_index, const Tensor& grad_scale, bool overwrite_logits) {
  detail::check_defined(logits, "cross_entropy", "logits");
  detail::check_defined(target, "cross_entropy", "target");
  CHORUS_CHECK(logits.dim() == 2 && is_floating(logits.dtype()),
               "cross_entropy: logits must be floating [rows, vocabulary], got ", logits.describe());
  CHORUS_CHECK(target.dim() == 1 && target.size(0) == logits.size(0), "cross_entropy: targets ", target.describe(),
               " must be [", logits.size(0), "] for logits ", shape_str(logits.sizes()));
  CHORUS_CHECK(target.dtype() == kInt64 || target.dtype() == kInt32, "cross_entropy: targets must be integers, got ",
               target.describe());
  CHORUS_CHECK(valid_cols >= 1 && valid_cols <= logits.size(1), "cross_entropy: vocabulary size ", valid_cols,
               " must be in [1, ", logits.size(1), "] for logits ", shape_str(logits.sizes()));
  const Device dev = logits.device();
  Tensor lg = contiguous(logits);
  Tensor tg = contiguous(to_dtype(to_device(target, dev), kInt64));
  Tensor losses = detail::empty_tensor({lg.size(0)}, lg.dtype() == kFloat64 ? kFloat64 : kFloat32, dev);
  Tensor dlogits = overwrite_logits ? lg : detail::empty_tensor(lg.sizes(), lg.dtype(), dev);
  Tensor sc = grad_scale.defined() ? to_dtype(to_device(grad_scale, dev), losses.dtype()) : Tensor();
  if (lg.numel()) CHORUS_KERNEL(dev, cross_entropy_fused, lg, tg, valid_cols, ignore_index, losses, dlogits, sc);
  return {losses, dlogits};
}

void scale_unless_one_(const Tensor& x, const Tensor& scale) {
  detail::check_defined(x, "scale_unless_one_", "x");
  detail::check_defined(scale, "scale_unless_one_", "scale");
  CHORUS_CHECK(scale.numel() == 1, "scale_unless_one_: the scale must have one element, got ", scale.describe());
  Tensor s = to_device(scale, x.device());
  if (s.dtype() != kFloat64) s = to_dtype(s, kFloat32);
  CHORUS_KERNEL(x.device(), scale_unless_one, x, s);
}

}  // namespace chorus::ops
