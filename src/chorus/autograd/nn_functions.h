// Differentiable neural-network ops: the forward through ops/, the backward
// formula recorded on the graph. No argument checks or autocast here: callers
// go through nn/functional.h, the thin user-facing API.
#pragma once

#include "chorus/core/tensor.h"
#include "chorus/ops/nn.h"

namespace chorus::autograd {

// y = x w^T + b over x [..., K] (w [N, K], b [N] or undefined: no bias, one
// dtype and device), the bias added in the product's epilogue and its
// gradient summed by the weight gradient's product (ops/linear.h). `weight_data` and `bias_data`, when
// defined, are what the products compute with in their places: autocast's
// 16-bit copies of float32 parameters (Note [Autocast weight copies]); the
// parameters' gradients then come out of the products in float32 (Note
// [Float weight gradients from 16-bit products] in cuda/blas/gemm.cpp)
// instead of through recorded casts' backwards.
Tensor linear_bias(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& weight_data = Tensor(),
                   const Tensor& bias_data = Tensor());
// A GPT MLP, gelu_tanh(x w1^T + b1) w2^T + b2 over x [..., C], as one node
// whose products carry GELU and its derivative (ops::mlp_gelu).
// recompute_gelu: keep only GELU's input for the backward, which computes its
// output again (Note [GELU recomputed in the backward] in nn_functions.cpp).
// `data`, empty or {w1, b1, w2, b2}'s 16-bit copies, as linear_bias's.
Tensor mlp_gelu(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2, const Tensor& b2,
                bool recompute_gelu = false, const TensorList& data = {});
// `weight_data`, when defined, is what the convolution computes with in
// weight's place: autocast's 16-bit copy of a float32 `weight` (Note [Autocast
// weight copies]). The filter gradient then reaches `weight` in its own dtype
// straight from the convolution (Note [Float filter gradients from 16-bit
// data] in cuda/conv/conv.cpp) instead of through a recorded cast's backward.
Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias, const ops::Conv2dParams& p,
              const Tensor& weight_data = Tensor());
// conv2d(x, weight) + residual, the add fused into the convolution where the
// device can (ops::conv2d_add); the residual's gradient is the output's.
Tensor conv2d_add(const Tensor& x, const Tensor& weight, const Tensor& residual, const ops::Conv2dParams& p,
                  const Tensor& weight_data = Tensor());
Tensor max_pool2d(const Tensor& x, const ops::Pool2dParams& p);
Tensor avg_pool2d(const Tensor& x, const ops::Pool2dParams& p);
Tensor adaptive_avg_pool2d(const Tensor& x, int64_t out_h, int64_t out_w);
// Training-mode batch norm (batch statistics; running statistics and the
// batch counter, when given, updated).
Tensor batch_norm_train(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                        const Tensor& bias, double momentum, double eps,
                        const Tensor& num_batches_tracked = Tensor());
// Training-mode batch norm followed by ReLU, fused where the device has it.
Tensor batch_norm_relu_train(const Tensor& x, const Tensor& running_mean, const Tensor& running_var,
                             const Tensor& weight, const Tensor& bias, double momentum, double eps,
                             const Tensor& num_batches_tracked = Tensor());
// The same over s = a + b: (s, relu(batch_norm(s))), the add done by the
// statistics pass where the device can (Note [Residual add left to the batch
// norm] in ops/nn.h); s's gradient reaches a and b as an add's.
std::pair<Tensor, Tensor> batch_norm_relu_sum_train(const Tensor& a, const Tensor& b, const Tensor& running_mean,
                                                    const Tensor& running_var, const Tensor& weight,
                                                    const Tensor& bias, double momentum, double eps,
                                                    const Tensor& num_batches_tracked = Tensor());
// Mean over the batch of the per-example cross entropy of `logits` [B, C].
Tensor cross_entropy_mean(const Tensor& logits, const Tensor& target, double label_smoothing);

}  // namespace chorus::autograd
