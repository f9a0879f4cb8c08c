// float64 convolution, pooling and batch norm on host memory: contiguous NCHW
// double, raw pointers. The same contracts as the float32 kernels of
// conv2d.h, pool.h and batch_norm.h (same geometry, index rule, divisors and
// statistics), written as direct loops over the definitions.
//
// Why it exists: gradient checks. Finite differences in double need a forward
// pass that is exact to ~1e-16; the float kernels would round it to ~1e-7 and
// force loose tolerances. Nothing else should want float64 convolutions, so
// these are single-threaded naive loops: obviously correct first, speed
// irrelevant. cpu/nn_kernels.cpp routes float64 tensors here.
//
// Geometry is validated by the caller (cpu/nn_kernels.cpp checks it with the
// float kernels' own checks) except for what only the kernel sees: bad
// max-pool indices, too few values per batch-norm channel, and the pooling
// "padding at most half the kernel" rule. Those throw std::invalid_argument
// naming the kernel, as the float kernels do.
#pragma once

#include <cstdint>

#include "chorus/cpu/conv2d.h"

namespace chorus::cpu::f64 {

// ---- convolution (weight [c_out, c_in / groups, kh, kw]) ------------------------

void conv2d_forward(const Conv2dShape& s, const double* x, const double* weight,
                    const double* bias, double* y);
void conv2d_backward_input(const Conv2dShape& s, const double* dy, const double* weight,
                           double* dx);
// dbias may be null.
void conv2d_backward_weight(const Conv2dShape& s, const double* dy, const double* x,
                            double* dweight, double* dbias);

// ---- pooling (floor-mode output sizes, PyTorch's semantics as in pool.h) ---------

void max_pool2d_forward(const double* x, int64_t n, int64_t c, int64_t h, int64_t w,
                        int64_t kernel_h, int64_t kernel_w, int64_t stride_h, int64_t stride_w,
                        int64_t pad_h, int64_t pad_w, double* y, int64_t* indices);
void max_pool2d_backward(const double* dy, const int64_t* indices, int64_t n, int64_t c,
                         int64_t h, int64_t w, int64_t out_h, int64_t out_w, double* dx);
// count_include_pad = true.
void avg_pool2d_forward(const double* x, int64_t n, int64_t c, int64_t h, int64_t w,
                        int64_t kernel_h, int64_t kernel_w, int64_t stride_h, int64_t stride_w,
                        int64_t pad_h, int64_t pad_w, double* y);
void avg_pool2d_backward(const double* dy, int64_t n, int64_t c, int64_t h, int64_t w,
                         int64_t kernel_h, int64_t kernel_w, int64_t stride_h, int64_t stride_w,
                         int64_t pad_h, int64_t pad_w, double* dx);
// Windows [floor(i*in/out), ceil((i+1)*in/out)).
void adaptive_avg_pool2d_forward(const double* x, int64_t n, int64_t c, int64_t h, int64_t w,
                                 int64_t out_h, int64_t out_w, double* y);
void adaptive_avg_pool2d_backward(const double* dy, int64_t n, int64_t c, int64_t h, int64_t w,
                                  int64_t out_h, int64_t out_w, double* dx);

// ---- batch norm over [n, c, h, w] (statistics per channel) ------------------------

// Normalises with the biased batch variance; moves running_var (when not null)
// towards the unbiased one. gamma/beta may be null (ones/zeros).
void batch_norm_forward_train(const double* x, int64_t n, int64_t c, int64_t h, int64_t w,
                              const double* gamma, const double* beta, double eps,
                              double momentum, double* running_mean, double* running_var,
                              double* y, double* save_mean, double* save_invstd);
void batch_norm_forward_eval(const double* x, int64_t n, int64_t c, int64_t h, int64_t w,
                             const double* gamma, const double* beta, const double* running_mean,
                             const double* running_var, double eps, double* y);
// Gradients of batch_norm_forward_train; dx, dgamma, dbeta may be null.
void batch_norm_backward(const double* dy, const double* x, int64_t n, int64_t c, int64_t h,
                         int64_t w, const double* gamma, const double* save_mean,
                         const double* save_invstd, double* dx, double* dgamma, double* dbeta);

}  // namespace chorus::cpu::f64
