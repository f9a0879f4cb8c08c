// Batch normalisation on host memory: x is [n, c, h, w] contiguous (or
// [n, c] with h = w = 1, or [n, c, l] with h = l, w = 1); statistics are per
// channel over n, h, w.
//
// Matches PyTorch's batch_norm: training normalises with the biased batch
// variance but moves running_var towards the unbiased one,
//   running = (1 - momentum) * running + momentum * batch_stat,
// and saves mean and 1/sqrt(var + eps) for the backward pass. Statistics are
// accumulated in double (a channel can sum millions of terms). gamma may be
// null (treated as ones), beta may be null (zeros); channels are split over
// the CPU pool.
#pragma once

#include <cstdint>

namespace chorus::cpu {

// y = (x - mean) * invstd * gamma + beta with the batch's statistics.
// Writes save_mean[c] and save_invstd[c]; updates running_mean / running_var
// when they are not null. Throws std::invalid_argument when a channel has
// fewer than 2 values (n*h*w < 2), as PyTorch does: the variance is undefined.
void batch_norm_forward_train(const float* x, int64_t n, int64_t c, int64_t h, int64_t w,
                              const float* gamma, const float* beta, float eps, float momentum,
                              float* running_mean, float* running_var, float* y, float* save_mean,
                              float* save_invstd);

// y = (x - running_mean) / sqrt(running_var + eps) * gamma + beta.
void batch_norm_forward_eval(const float* x, int64_t n, int64_t c, int64_t h, int64_t w,
                             const float* gamma, const float* beta, const float* running_mean,
                             const float* running_var, float eps, float* y);

// Gradients of batch_norm_forward_train (the batch statistics depend on x):
//   dx = gamma * invstd * (dy - mean(dy) - xhat * mean(dy * xhat)),
//   dgamma = sum(dy * xhat), dbeta = sum(dy), xhat = (x - save_mean) * save_invstd.
// Any of dx, dgamma, dbeta may be null (not wanted). Overwrites them.
void batch_norm_backward(const float* dy, const float* x, int64_t n, int64_t c, int64_t h,
                         int64_t w, const float* gamma, const float* save_mean,
                         const float* save_invstd, float* dx, float* dgamma, float* dbeta);

// Gradients of batch_norm_forward_eval (fixed statistics, so dx is a per-
// channel scale of dy): dx = dy * gamma * invstd, dgamma = sum(dy * xhat),
// dbeta = sum(dy), with invstd = 1/sqrt(running_var + eps). Outputs nullable.
void batch_norm_backward_eval(const float* dy, const float* x, int64_t n, int64_t c, int64_t h,
                              int64_t w, const float* gamma, const float* running_mean,
                              const float* running_var, float eps, float* dx, float* dgamma,
                              float* dbeta);

}  // namespace chorus::cpu
