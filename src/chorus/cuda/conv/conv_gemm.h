// Convolutions of few input channels as one GEMM and a gather (Note
// [Convolutions of few input channels as GEMMs]). Include only from
// src/chorus/cuda.
#pragma once

#include "chorus/core/op_kinds.h"
#include "chorus/core/tensor.h"
#include "chorus/cuda/cudnn/cudnn_handle.h"

namespace chorus::cuda {

// Note [Convolutions of few input channels as GEMMs]
// A convolution whose input has few channels (Wide ResNet's first block: 16
// channels in, 160 out, 3x3, at 32x32) is a poor fit for cuDNN's tensor-core
// kernels: the data gradient's output rows are 16 channels wide, a sliver of
// their tiles. As GEMMs over the im2col matrix cols[m, (r, s, c)] (m an output
// pixel; kh*kw*C columns, 144 there) the shapes are tensor-core friendly:
//   forward   y[M, K]       = cols(x)[M, RSC] @ W[K, RSC]^T
//   dgrad     dcols[M, RSC] = dy[M, K] @ W[K, RSC], then dx = col2im(dcols)
//   wgrad     dW[K, RSC]    = dy[M, K]^T @ cols(x)[M, RSC]
// (W in the channels-last filter layout, [K][R][S][C], is the [K, RSC] matrix
// as it is stored). The price is the cols matrix in memory (M x RSC, 38 MB
// there) written and read once. Each geometry and direction is timed once
// both ways (cuDNN, and this; conv.cpp) and runs the faster from then on, the
// GEMM only when 3% ahead. On an H100 (WRN-28-10 bf16 batch 128) the 16 ->
// 160 data gradient went to the GEMM; the forward, the weight gradient and
// the 1x1 shortcut's stayed with cuDNN; whole graphed steps gained a little
// against CHORUS_CONV_GEMM=0 (the layer's data gradient runs beside the
// weight gradients, slower than alone): benchmarks journal, session 26. The
// data gradient's dcols holds each of the kh*kw products rounded to the data's
// dtype before col2im sums them in float (cuDNN rounds the sum once): a few
// ulps of bfloat16 more error in dx.

// Whether the GEMM path can compute this convolution: channels-last 16-bit
// data, one group, input channels a multiple of 8 and at most 32.
bool conv_gemm_applies(const Conv2dGeometry& g, Layout layout, DType dtype);

// The three directions. Tensors are channels-last (NHWC) and dense; `w` is the
// filter in the channels-last layout; dw is written in x's dtype, channels-last.
void conv_gemm_forward(const Conv2dGeometry& g, const Tensor& x, const Tensor& w, const Tensor& y);
void conv_gemm_backward_input(const Conv2dGeometry& g, const Tensor& dy, const Tensor& w, const Tensor& dx);
void conv_gemm_backward_weight(const Conv2dGeometry& g, const Tensor& dy, const Tensor& x, const Tensor& dw);

// Whether CHORUS_CONV_GEMM (default on) allows the path; tests turn it on
// and off.
bool conv_gemm_enabled();
void set_conv_gemm_enabled(bool on);

}  // namespace chorus::cuda
