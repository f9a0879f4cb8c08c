// Batch norm on channels-last (NHWC) activations, with Chorus's own kernels.
//
// Note [NHWC batch norm]: cuDNN's batch norm on NHWC data (spatial or
// spatial-persistent mode) ran several times slower than on NCHW in a Wide
// ResNet on H100, and took most of a bf16 channels-last training step
// (benchmarks journal, session 2). PyTorch uses its
// own channels-last kernels for the same reason. An NHWC tensor is a row-major
// [M, C] matrix (M = N*H*W), so: per-channel statistics are column reductions
// (Welford partials per block of rows, combined per channel), and the
// normalisation and its gradient are elementwise with per-channel
// coefficients. Statistics and parameters are float32 for every data type.
//
// All tensors are on one CUDA device; x, y, dy, dx are 4-d and dense
// channels-last of one dtype; the [C] vectors are contiguous float32.
// Running statistics may be undefined (no update). `relu` fuses a following
// ReLU into the forward pass; the backward (relu, with the forward's beta)
// masks dy on the fly where the forward's output was positive, recomputed
// from x (Note [ReLU mask from x] in batch_norm_nhwc.cu).
#pragma once

#include "chorus/core/tensor.h"

namespace chorus::cuda {

void batch_norm_nhwc_forward_train(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                   const Tensor& running_mean, const Tensor& running_var,
                                   double momentum, double eps, const Tensor& y,
                                   const Tensor& save_mean, const Tensor& save_invstd,
                                   bool relu = false, const Tensor& num_batches_tracked = Tensor());

// The same over x = a + b (a, b dense channels-last like x), x written by the
// statistics pass as it reads a and b (Note [Residual add left to the batch
// norm] in ops/nn.h): one pass fewer than the add and then the statistics.
void batch_norm_nhwc_forward_train_sum(const Tensor& a, const Tensor& b, const Tensor& x, const Tensor& gamma,
                                       const Tensor& beta, const Tensor& running_mean, const Tensor& running_var,
                                       double momentum, double eps, const Tensor& y, const Tensor& save_mean,
                                       const Tensor& save_invstd, bool relu,
                                       const Tensor& num_batches_tracked = Tensor());

void batch_norm_nhwc_forward_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                  const Tensor& running_mean, const Tensor& running_var,
                                  double eps, const Tensor& y);

void batch_norm_nhwc_backward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                              const Tensor& save_mean, const Tensor& save_invstd,
                              const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta,
                              bool relu = false, const Tensor& beta = Tensor(),
                              const Tensor& dx_addend = Tensor());

}  // namespace chorus::cuda
