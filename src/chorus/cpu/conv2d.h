// 2-d convolution on host memory: contiguous NCHW float32, raw pointers.
//
// im2col + GEMM (OpenBLAS). The im2col buffer holds a chunk of several images
// side by side, [c_in*kh*kw, images*out_h*out_w], so that one GEMM covers the
// chunk and small layers (14x14 planes) still make GEMMs worth their packing.
// Chunks run in parallel on the CPU pool (chorus/cpu/parallel.h), each with
// single-threaded GEMMs. Scratch buffers are thread_local and only grow, so a
// training loop does no heap allocation here after its first step. 1x1
// stride-1 unpadded convolutions skip im2col: each image is its own column
// matrix.
#pragma once

#include <cstdint>

namespace chorus::cpu {

// Sizes of one convolution. Weight is [c_out, c_in / groups, kh, kw]; the
// output is [n, c_out, out_h(), out_w()]. Aggregate, so it can be written
// Conv2dShape{.n = 8, .c_in = 3, ...}; unnamed fields take the defaults.
struct Conv2dShape {
  int64_t n = 1, c_in = 1, h = 1, w = 1, c_out = 1, kh = 1, kw = 1;
  int64_t stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0, dil_h = 1, dil_w = 1;
  int64_t groups = 1;

  int64_t out_h() const { return (h + 2 * pad_h - dil_h * (kh - 1) - 1) / stride_h + 1; }
  int64_t out_w() const { return (w + 2 * pad_w - dil_w * (kw - 1) - 1) / stride_w + 1; }
};

// Throws std::invalid_argument, naming `kernel` and the offending fields, if
// the shape is not a valid convolution (non-positive sizes, channels not
// divisible by groups, kernel larger than the padded input, ...).
void check_conv2d_shape(const char* kernel, const Conv2dShape& s);

// y = conv(x, weight) + bias. bias may be null.
void conv2d_forward(const Conv2dShape& s, const float* x, const float* weight, const float* bias,
                    float* y);

// dx = d(loss)/dx given dy = d(loss)/dy. Overwrites dx.
void conv2d_backward_input(const Conv2dShape& s, const float* dy, const float* weight, float* dx);

// dweight (and dbias, when not null) = gradients summed over the batch.
// Overwrites both.
void conv2d_backward_weight(const Conv2dShape& s, const float* dy, const float* x, float* dweight,
                            float* dbias);

}  // namespace chorus::cpu
