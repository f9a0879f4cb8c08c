// The kernel set that every device layer implements (cpu/kernels.h and
// cuda/kernels/kernels.h instantiate this list in their namespaces), so ops/ dispatches
// with one `if` per op and both devices share one contract:
//  - all tensors are on the same device; outputs are allocated by the caller;
//  - "strided" arguments may be any view (broadcast views have stride 0);
//  - "contiguous" arguments are row-major contiguous;
//  - float math accumulates in float32 (bf16/f16 are converted on load/store).
#pragma once

#include <cstdint>
#include <vector>

#include "chorus/core/op_kinds.h"
#include "chorus/core/rng.h"
#include "chorus/core/tensor.h"

#define CHORUS_DECLARE_KERNELS                                                                     \
  /* out[i] = op(x[i], scalar). x, out strided, same shape; out dtype = x's                      \
     (bool for GtScalar). */                                                                      \
  void unary(UnaryOp op, const Tensor& x, const Tensor& out, double scalar);                      \
  /* out = op(a, b). a, b, out strided with out's shape; a and b have one dtype; out has it too    \
     (bool for comparisons). out may alias a (in-place). */                                       \
  void binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out, double alpha);    \
  /* dst = src, converting dtype; same shape, both strided. */                                    \
  void copy(const Tensor& src, const Tensor& dst);                                                \
  /* dsts[i] = srcs[i] for many pairs at once (one launch per few dozen pairs on a GPU): each     \
     pair of one dtype and numel, both contiguous (any shapes: a pair is one range of bytes; ops  \
     passes flat 1-d views of other dense layouts), all on one device; no destination overlaps    \
     another pair's tensors or, partly, its own source (a pair whose source is its destination    \
     is skipped). */                                                                              \
  void copy_multi(const TensorList& srcs, const TensorList& dsts);                                \
  void fill(const Tensor& out, double value);                                                     \
  /* out (contiguous) has x's shape with reduced dims set to 1; reduce[d] says which. Sum/Mean/  \
     Max/Min keep x's dtype (float accumulation); Argmax/Argmin write int64 and need exactly one  \
     reduced dim. */                                                                              \
  void reduce(ReduceOp op, const Tensor& x, const Tensor& out, const std::vector<bool>& reduce);   \
  /* Random fills of a contiguous tensor; element i uses Philox word(s) i of `rng`. */            \
  void uniform(const Tensor& out, double lo, double hi, RngState rng);                            \
  void normal(const Tensor& out, double mean, double std, RngState rng);                          \
  void randint(const Tensor& out, int64_t lo, int64_t hi, RngState rng);                          \
  /* out[i] = (uniform(i) >= p) ? 1/(1-p) : 0 */                                                  \
  void dropout_mask(const Tensor& out, double p, RngState rng);                                   \
  /* out[b] = alpha * op(a[b]) @ op(bm[b]) + beta * out[b]; a, bm, out contiguous 3-d             \
     (batch, rows, cols) as stored; op transposes when the flag is set. */                        \
  void gemm(const Tensor& a, const Tensor& bm, const Tensor& out, bool trans_a, bool trans_b,     \
            double alpha, double beta);                                                           \
  /* A linear layer's product: out = op(a) @ op(bm) for 2-d contiguous operands of one dtype,   \
     with the bias epilogue -- bias [out cols] (out's dtype) added to every row when defined --  \
     and the bias gradient -- bias_grad [out rows] (out's dtype) overwritten with the row sums   \
     of op(a) when defined: dW = dY^T X gives db = column sums of dY from the same read. out    \
     (and bias_grad; no bias then) may be float32 over 16-bit a and bm: a float32 weight's       \
     gradient from its 16-bit copy's product. */                                                  \
  void gemm_bias(const Tensor& a, const Tensor& bm, const Tensor& out, bool trans_a, bool trans_b, \
                 const Tensor& bias, const Tensor& bias_grad);                                    \
  /* A GPT MLP's first product with GELU (tanh form) in its epilogue: pre = a @ bm^T + bias    \
     (kept for the backward) and out = gelu_tanh(pre); a [M, K], bm [N, K], bias [N], pre and    \
     out [M, N], contiguous, one dtype. */                                                         \
  void gemm_bias_gelu(const Tensor& a, const Tensor& bm, const Tensor& bias, const Tensor& pre,   \
                      const Tensor& out);                                                         \
  /* GELU's backward after the product that makes its input's gradient:                        \
     out = (a @ bm) * gelu_tanh'(pre) for a [M, K], bm [K, N], pre and out [M, N], and           \
     bias_grad [N] (when defined; out's dtype, or float32) = the column sums of out: the first    \
     product's bias gradient. */                                                                  \
  void gemm_dgelu(const Tensor& a, const Tensor& bm, const Tensor& pre, const Tensor& out,       \
                  const Tensor& bias_grad);                                                       \
  /* Convolution: x [N,C,H,W], weight [K,C/g,R,S], bias [K] or undefined, y [N,K,P,Q]; all       \
     contiguous NCHW. Backward kernels overwrite their outputs. */                                \
  void conv2d_forward(const Conv2dGeometry& g, const Tensor& x, const Tensor& weight,             \
                      const Tensor& bias, const Tensor& y);                                       \
  /* y = conv(x, weight) + residual, no bias: residual [N,K,P,Q] of y's dtype and layout, not    \
     overlapping y (CUDA adds it in the convolution's epilogue where cuDNN can). */               \
  void conv2d_forward_add(const Conv2dGeometry& g, const Tensor& x, const Tensor& weight,         \
                          const Tensor& residual, const Tensor& y);                               \
  /* Whether conv(x, weight) + residual costs less left unsummed, the add done by the batch norm \
     that reads the sum next (batch_norm_relu_sum_forward), than as conv2d_forward_add (CUDA     \
     times both per geometry; the CPU always leaves it: the add is one pass either way). */      \
  bool conv2d_add_defers(const Conv2dGeometry& g, const Tensor& x, const Tensor& weight,          \
                         const Tensor& residual);                                                 \
  void conv2d_backward_input(const Conv2dGeometry& g, const Tensor& dy, const Tensor& weight,     \
                             const Tensor& dx);                                                   \
  void conv2d_backward_weight(const Conv2dGeometry& g, const Tensor& dy, const Tensor& x,         \
                              const Tensor& dweight, const Tensor& dbias);                        \
  /* Pooling on contiguous NCHW. indices: int64, index within the input plane (h*W+w). */         \
  void max_pool2d_forward(const Pool2dGeometry& g, const Tensor& x, const Tensor& y,              \
                          const Tensor& indices);                                                 \
  void max_pool2d_backward(const Pool2dGeometry& g, const Tensor& dy, const Tensor& indices,      \
                           const Tensor& dx);                                                     \
  /* count_include_pad = true, as PyTorch's default. */                                           \
  void avg_pool2d_forward(const Pool2dGeometry& g, const Tensor& x, const Tensor& y);             \
  void avg_pool2d_backward(const Pool2dGeometry& g, const Tensor& dy, const Tensor& dx);          \
  void adaptive_avg_pool2d_forward(const Tensor& x, const Tensor& y);                             \
  void adaptive_avg_pool2d_backward(const Tensor& dy, const Tensor& dx);                          \
  /* Batch norm over [N,C,*] contiguous. Training: batch statistics, writes save_mean and         \
     save_invstd [C] (float32; float64 for a float64 x, which only the CPU accepts) and           \
     updates running stats (unbiased variance, momentum) when defined. Eval: uses running         \
     stats. gamma/beta may be undefined (1 and 0). num_batches_tracked (int64 [], may be         \
     undefined) is incremented when training, by the pass that updates the running statistics   \
     (no launch of its own on a GPU). */                                                          \
  void batch_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta,               \
                          const Tensor& running_mean, const Tensor& running_var, bool training,   \
                          double momentum, double eps, const Tensor& y, const Tensor& save_mean,  \
                          const Tensor& save_invstd, const Tensor& num_batches_tracked = Tensor()); \
  /* Training-mode backward. dgamma/dbeta may be undefined. */                                    \
  void batch_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,                \
                           const Tensor& save_mean, const Tensor& save_invstd, const Tensor& dx,  \
                           const Tensor& dgamma, const Tensor& dbeta);                            \
  /* Training-mode batch norm followed by ReLU, y = max(0, bn(x)) (one pass on channels-last     \
     GPUs); statistics as batch_norm_forward. */                                                  \
  void batch_norm_relu_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta,          \
                               const Tensor& running_mean, const Tensor& running_var,             \
                               double momentum, double eps, const Tensor& y,                      \
                               const Tensor& save_mean, const Tensor& save_invstd,                \
                               const Tensor& num_batches_tracked = Tensor());                     \
  /* s = a + b (one dtype, s's sizes), then batch_norm_relu_forward over s (Note [Residual add  \
     left to the batch norm], ops/nn.h): one pass reads a and b, writes s and takes the          \
     statistics on channels-last GPUs. */                                                         \
  void batch_norm_relu_sum_forward(const Tensor& a, const Tensor& b, const Tensor& s,             \
                                   const Tensor& gamma, const Tensor& beta,                       \
                                   const Tensor& running_mean, const Tensor& running_var,         \
                                   double momentum, double eps, const Tensor& y,                  \
                                   const Tensor& save_mean, const Tensor& save_invstd,            \
                                   const Tensor& num_batches_tracked);                            \
  /* Its backward: dy masked by y > 0, then batch_norm_backward (beta: the forward's, for       \
     backends that recompute the mask from x; may be undefined, 0). dx_addend, when defined (x's  \
     sizes, dtype and layout), is added to dx (Note [Gradient addends], autograd/node.h). */      \
  void batch_norm_relu_backward(const Tensor& dy, const Tensor& y, const Tensor& x,               \
                                const Tensor& gamma, const Tensor& beta, const Tensor& save_mean, \
                                const Tensor& save_invstd, const Tensor& dx, const Tensor& dgamma, \
                                const Tensor& dbeta, const Tensor& dx_addend);                    \
  /* Softmax over the last dim of a contiguous [rows, cols] tensor. */                            \
  void softmax_forward(const Tensor& x, const Tensor& y, bool log);                               \
  /* dx = log ? dy - exp(y) * sum(dy) : y * (dy - sum(dy * y)) per row. */                        \
  void softmax_backward(const Tensor& dy, const Tensor& y, const Tensor& dx, bool log);           \
  /* Cross entropy of logits [B,C] (contiguous) and int64 targets [B]: per-sample losses [B]     \
     (float32) with label smoothing eps: -(1-eps)*logp[y] - eps/C*sum(logp). Also writes the      \
     softmax probabilities [B,C] (float32) for the backward pass. */                              \
  void cross_entropy_forward(const Tensor& logits, const Tensor& target, double smoothing,        \
                             const Tensor& losses, const Tensor& probs);                          \
  /* dlogits[b,c] = dloss[b] * (probs[b,c] - (1-eps)*[c==y_b] - eps/C). dloss [B] float32. */     \
  void cross_entropy_backward(const Tensor& dloss, const Tensor& probs, const Tensor& target,     \
                              double smoothing, const Tensor& dlogits);                           \
  /* Indexing on contiguous tensors viewed as [outer, dim, inner]. index int64 contiguous. */     \
  void index_select(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& out);        \
  /* out (pre-filled) [..., index[i], ...] += src[..., i, ...] */                                  \
  void index_add(const Tensor& out, int64_t dim, const Tensor& index, const Tensor& src);         \
  void gather(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& out);              \
  /* out (pre-filled) scatter-add: out[.., index[..i..], ..] += src[..i..] */                     \
  void scatter_add(const Tensor& out, int64_t dim, const Tensor& index, const Tensor& src);       \
  /* Fused optimizer updates on contiguous float32 tensors of one size. */                        \
  void sgd_update(const Tensor& param, const Tensor& grad, const Tensor& momentum_buf, double lr,  \
                  double momentum, double dampening, double weight_decay, bool nesterov,          \
                  bool first_step);                                                               \
  /* sgd_update of many parameters of one device at once (one launch on a GPU). When defined,  */ \
  /* `scalars` (float32 [lr, step] on the device) overrides lr: Note [Optimizer scalars on the   */ \
  /* device] in optim/optimizer.h; likewise lr and step for adamw_update_multi. `copies` (empty,  */ \
  /* or one per parameter, undefined where none): the updated parameter is also written, rounded, */ \
  /* into that bfloat16/float16 tensor of its size (Note [Autocast weight copies]). `addends`     */ \
  /* (empty, or one per parameter, undefined where none; float32, the gradient's size): the      */ \
  /* gradient used is grads[i] + addends[i], one float addition (Note [Gradient sums in the      */ \
  /* update] in data_parallel/reducer.h); likewise for adamw_update_multi.                                */ \
  void sgd_update_multi(const TensorList& params, const TensorList& grads,                        \
                        const TensorList& momentum_bufs, double lr, double momentum,              \
                        double dampening, double weight_decay, bool nesterov, bool first_step,    \
                        const Tensor& scalars, const TensorList& copies, const TensorList& addends); \
  void adamw_update(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,               \
                    const Tensor& exp_avg_sq, double lr, double beta1, double beta2, double eps,  \
                    double weight_decay, int64_t step);                                           \
  /* adamw_update of many parameters of one device and one step count (one launch on a GPU).     \
     `grad_scale`, when defined (one float32 element on the parameters' device; float64 too on a \
     CPU), multiplies every gradient as it is read, after its addend: the update of gradients    \
     scaled in place by scale_multi, read from the device (Note [Clipping in the update] in      \
     optim/clip_grad.h). `copies` as sgd_update_multi's. */                                     \
  void adamw_update_multi(const TensorList& params, const TensorList& grads,                      \
                          const TensorList& exp_avgs, const TensorList& exp_avg_sqs, double lr,   \
                          double beta1, double beta2, double eps, double weight_decay,            \
                          int64_t step, const Tensor& scalars, const TensorList& addends,         \
                          const Tensor& grad_scale, const TensorList& copies = {});               \
  /* Gradient clipping's two passes over many tensors at once (each contiguous and floating, all \
     on one device; a few launches for any number). sum_squares_multi: out [] (float32; float64  \
     when the xs are) = the sum of squares of all their elements, in a fixed order.             \
     scale_multi: every xs[i] *= scale (a one-element float32 or float64 tensor). */            \
  void sum_squares_multi(const TensorList& xs, const Tensor& out);                                \
  void scale_multi(const TensorList& xs, const Tensor& scale);                                    \
  /* Layer norm over the last dim of contiguous x [rows, cols]: y = (x - mean) * rstd * gamma +  \
     beta, y of x's dtype; mean and rstd [rows] float32 (float64 for a float64 x). gamma, beta   \
     [cols] of x's dtype or float32 (float32 master weights beside 16-bit activations), each may \
     be undefined (1, 0). */                                                                      \
  void layer_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps,   \
                          const Tensor& y, const Tensor& mean, const Tensor& rstd);               \
  /* Its backward: dx (x's dtype) overwritten; dgamma, dbeta (gamma's dtype, [cols]) overwritten \
     when defined. dres (x's shape and dtype, contiguous), when defined, is added to dx in the   \
     same pass: the residual stream's own gradient (Note [Residual add beside layer norm]). */   \
  void layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,                \
                           const Tensor& mean, const Tensor& rstd, const Tensor& dres,            \
                           const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta);          \
  /* The residual add and the layer norm of its result in one pass: sum = x + r (contiguous, one \
     dtype and shape), y = layer_norm(sum) read from sum as stored (rounded to its dtype), mean  \
     and rstd as layer_norm_forward's. */                                                         \
  void add_layer_norm_forward(const Tensor& x, const Tensor& r, const Tensor& gamma,              \
                              const Tensor& beta, double eps, const Tensor& sum, const Tensor& y, \
                              const Tensor& mean, const Tensor& rstd);                            \
  /* Attention's softmax over the last dim of contiguous scores [batch, T, S] (one dtype with y): \
     y = softmax(scale * x), with column j of row i masked (y = 0) when causal and j > i + S - T. \
     Every row keeps at least one column when causal (S >= T). */                                 \
  void attention_softmax_forward(const Tensor& x, double scale, bool causal, const Tensor& y);     \
  /* dx = scale * y * (dy - sum(dy * y)) per row (masked columns: 0, unread where causal says    \
     they are masked). */                                                                         \
  void attention_softmax_backward(const Tensor& dy, const Tensor& y, double scale, bool causal,   \
                                  const Tensor& dx);                                              \
  /* Fused (flash) attention where the device has one (cuDNN's on CUDA; the CPU has none): q     \
     [B, H, T, D], k and v [B, H, S, D], out [B, H, T, D] strided views of one 16-bit float dtype \
     (last dim contiguous); stats [B, H, T] float32 contiguous, each row's log-sum-exp of its    \
     scaled scores; causal masks key j > query i (top-left, T == S). Returns false and writes   \
     nothing when no fused kernel takes the case (ops/ then takes the composite path). */       \
  bool attention_fused_forward(const Tensor& q, const Tensor& k, const Tensor& v, double scale,    \
                               bool causal, const Tensor& out, const Tensor& stats);              \
  /* Its backward from the forward's out and stats: dq, dk, dv (strided, q's dtype) overwritten.  \
     Returns false, writing nothing, where the forward would. */                                  \
  bool attention_fused_backward(const Tensor& dout, const Tensor& q, const Tensor& k,             \
                                const Tensor& v, const Tensor& out, const Tensor& stats,          \
                                double scale, bool causal, const Tensor& dq, const Tensor& dk,    \
                                const Tensor& dv);                                                \
  /* The classifier's loss and gradient in one pass (llm.c's fused classifier): logits [N, V]     \
     contiguous, columns >= valid_cols left out (padding of the vocabulary: probability 0,       \
     gradient 0); int64 targets [N], rows whose target is ignore_index get loss 0 and gradient   \
     0. losses [N] float32 (float64 for float64 logits); dlogits [N, V] of the logits' dtype =    \
     (softmax - one_hot(target)) x grad_scale, the gradient of each row's loss times a scale     \
     (a one-element float32 tensor -- float64 for float64 logits -- on the device, read there;   \
     undefined: 1), e.g. 1/N for a mean (may alias logits). A target outside [0, valid_cols)     \
     that is not ignore_index is an error (CPU) or a NaN loss (CUDA). */                         \
  void cross_entropy_fused(const Tensor& logits, const Tensor& target, int64_t valid_cols,        \
                           int64_t ignore_index, const Tensor& losses, const Tensor& dlogits,     \
                           const Tensor& grad_scale);                                             \
  /* x *= scale in place (a one-element float32 or float64 tensor on x's device, read there),    \
     nothing written when scale is exactly 1: on CUDA each block reads it and returns, so the    \
     common case (backward's seed of 1) costs one launch, also inside a CUDA graph. */           \
  void scale_unless_one(const Tensor& x, const Tensor& scale);
