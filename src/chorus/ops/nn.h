// Raw neural-network ops: shape checks, output allocation and dispatch. The
// differentiable versions are in nn/functional.h.
#pragma once

#include <optional>
#include <tuple>

#include "chorus/core/op_kinds.h"
#include "chorus/core/tensor.h"

namespace chorus::ops {

struct Conv2dParams {
  int64_t stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0, dil_h = 1, dil_w = 1, groups = 1;
};
Conv2dGeometry conv2d_geometry(const Tensor& x, const Tensor& w, const Conv2dParams& p);
Tensor conv2d(const Tensor& x, const Tensor& w, const Tensor& bias, const Conv2dParams& p);
// conv2d(x, w) + residual in one pass where the device can (a residual
// block's last convolution; Note [Residual add in the epilogue] in
// cuda/conv/conv.cpp). residual: the output's shape and x's dtype.
Tensor conv2d_add(const Tensor& x, const Tensor& w, const Tensor& residual, const Conv2dParams& p);
// Note [Residual add left to the batch norm]: a pre-activation residual block
// ends in s = conv(h) + shortcut, and the next block begins with
// relu(batch_norm(s)), whose statistics pass reads s. Leaving the add to that
// pass (batch_norm_relu_sum: it reads conv(h) and the shortcut, writes s and
// sums the statistics) costs one read and one write more than the plain
// statistics pass, where the add in the convolution's epilogue (conv2d_add)
// slows a wide convolution more (Wide ResNet-28-10, bf16, H100, at 32x32x160;
// benchmarks journal, session 24). Whether to leave it is the device's choice per geometry:
// conv2d_add_defers (CUDA times both; the CPU always leaves it).
bool conv2d_add_defers(const Tensor& x, const Tensor& w, const Tensor& residual, const Conv2dParams& p);
Tensor conv2d_backward_input(const Tensor& dy, const Tensor& x, const Tensor& w, const Conv2dParams& p);
// Returns (dweight, dbias); dbias undefined unless with_bias. dweight is in
// `dw_dtype` (default: w's): float32 for 16-bit data is the float sum itself,
// not a rounded 16-bit one (Note [Float filter gradients from 16-bit data] in
// cuda/conv/conv.cpp).
std::pair<Tensor, Tensor> conv2d_backward_weight(const Tensor& dy, const Tensor& x, const Tensor& w,
                                                 const Conv2dParams& p, bool with_bias,
                                                 std::optional<DType> dw_dtype = std::nullopt);

struct Pool2dParams {
  int64_t kh, kw, stride_h, stride_w, pad_h = 0, pad_w = 0;
};
Pool2dGeometry pool2d_geometry(const Tensor& x, const Pool2dParams& p, const char* op);
std::pair<Tensor, Tensor> max_pool2d(const Tensor& x, const Pool2dParams& p);  // (y, indices)
Tensor max_pool2d_backward(const Tensor& dy, const Tensor& x, const Tensor& indices, const Pool2dParams& p);
Tensor avg_pool2d(const Tensor& x, const Pool2dParams& p);
Tensor avg_pool2d_backward(const Tensor& dy, const Tensor& x, const Pool2dParams& p);
Tensor adaptive_avg_pool2d(const Tensor& x, int64_t out_h, int64_t out_w);
Tensor adaptive_avg_pool2d_backward(const Tensor& dy, const Tensor& x);

// (y, save_mean, save_invstd). num_batches_tracked (int64 [], may be
// undefined): incremented in training by the pass that updates the running
// statistics.
std::tuple<Tensor, Tensor, Tensor> batch_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                              const Tensor& running_mean, const Tensor& running_var,
                                              bool training, double momentum, double eps,
                                              const Tensor& num_batches_tracked = Tensor());
// (dx, dgamma, dbeta)
std::tuple<Tensor, Tensor, Tensor> batch_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                                       const Tensor& save_mean, const Tensor& save_invstd);

// Training-mode batch norm fused with the ReLU after it: (y, save_mean, save_invstd).
std::tuple<Tensor, Tensor, Tensor> batch_norm_relu(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                                   const Tensor& running_mean, const Tensor& running_var,
                                                   double momentum, double eps,
                                                   const Tensor& num_batches_tracked = Tensor());
// Training-mode batch norm + ReLU over s = a + b (one shape, dtype and device):
// (s, y, save_mean, save_invstd), s in a's layout (Note [Residual add left to
// the batch norm] above).
std::tuple<Tensor, Tensor, Tensor, Tensor> batch_norm_relu_sum(const Tensor& a, const Tensor& b, const Tensor& gamma,
                                                               const Tensor& beta, const Tensor& running_mean,
                                                               const Tensor& running_var, double momentum,
                                                               double eps,
                                                               const Tensor& num_batches_tracked = Tensor());
// (dx, dgamma, dbeta), from the fused forward's output y and its beta (may
// be undefined: 0; channels-last GPUs recompute the ReLU's mask from x).
// dx_addend, when defined, is added to dx in the same pass where the backend
// can (Note [Gradient addends] in autograd/node.h).
std::tuple<Tensor, Tensor, Tensor> batch_norm_relu_backward(const Tensor& dy, const Tensor& y, const Tensor& x,
                                                            const Tensor& gamma, const Tensor& beta,
                                                            const Tensor& save_mean, const Tensor& save_invstd,
                                                            const Tensor& dx_addend = Tensor());

Tensor softmax(const Tensor& x, int64_t dim, bool log);
Tensor softmax_backward(const Tensor& dy, const Tensor& y, int64_t dim, bool log);
// (per-sample losses [B] float32, probs [B, C] float32)
std::pair<Tensor, Tensor> cross_entropy(const Tensor& logits, const Tensor& target, double smoothing);
Tensor cross_entropy_backward(const Tensor& dloss, const Tensor& probs, const Tensor& target,
                              double smoothing, DType logits_dtype);
Tensor dropout_mask(const Shape& shape, DType dt, Device dev, double p);

}  // namespace chorus::ops
