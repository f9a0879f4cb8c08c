// 2-d pooling on host memory: contiguous NCHW float32, raw pointers.
//
// Semantics follow PyTorch's defaults so that results match it bit for bit
// where the arithmetic allows: floor-mode output sizes (ceil_mode=false),
// max pooling that propagates NaN and records argmax indices into the input
// plane (ih * w + iw, as torch.nn.functional.max_pool2d's return_indices),
// average pooling with count_include_pad=true, and adaptive average pooling
// with windows [floor(i*in/out), ceil((i+1)*in/out)). Planes (n*c of them)
// are independent and are split over the CPU pool.
#pragma once

#include <cstdint>

namespace chorus::cpu {

// floor((in + 2*pad - kernel) / stride) + 1; throws std::invalid_argument if
// the window does not fit (result < 1) or a parameter is out of range.
int64_t pool_out_size(int64_t in, int64_t kernel, int64_t stride, int64_t pad);

// y[n, c, oh, ow] = max over the window; indices (same shape) = flat position
// of that max in the input plane. Padding never wins (it acts as -inf).
// Requires pad <= kernel / 2, as PyTorch does.
void max_pool2d_forward(const float* x, int64_t n, int64_t c, int64_t h, int64_t w,
                        int64_t kernel_h, int64_t kernel_w, int64_t stride_h, int64_t stride_w,
                        int64_t pad_h, int64_t pad_w, float* y, int64_t* indices);

// dx = 0, then dx[plane][indices[o]] += dy[o] for each output o. Overwrites dx.
void max_pool2d_backward(const float* dy, const int64_t* indices, int64_t n, int64_t c, int64_t h,
                         int64_t w, int64_t out_h, int64_t out_w, float* dx);

// Mean over the window, zero padding counted in the divisor
// (count_include_pad=true). Requires pad <= kernel / 2.
void avg_pool2d_forward(const float* x, int64_t n, int64_t c, int64_t h, int64_t w,
                        int64_t kernel_h, int64_t kernel_w, int64_t stride_h, int64_t stride_w,
                        int64_t pad_h, int64_t pad_w, float* y);

// Adjoint of avg_pool2d_forward. Overwrites dx.
void avg_pool2d_backward(const float* dy, int64_t n, int64_t c, int64_t h, int64_t w,
                         int64_t kernel_h, int64_t kernel_w, int64_t stride_h, int64_t stride_w,
                         int64_t pad_h, int64_t pad_w, float* dx);

// y[n, c, out_h, out_w]: mean over PyTorch's adaptive windows. out may exceed
// the input size (windows then overlap).
void adaptive_avg_pool2d_forward(const float* x, int64_t n, int64_t c, int64_t h, int64_t w,
                                 int64_t out_h, int64_t out_w, float* y);

// Adjoint of adaptive_avg_pool2d_forward. Overwrites dx.
void adaptive_avg_pool2d_backward(const float* dy, int64_t n, int64_t c, int64_t h, int64_t w,
                                  int64_t out_h, int64_t out_w, float* dx);

}  // namespace chorus::cpu
