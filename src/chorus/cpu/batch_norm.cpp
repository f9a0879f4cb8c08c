// See batch_norm.h. Every kernel is "per channel: reduce, then map": the
// reductions walk the channel's n planes of h*w contiguous floats in double,
// the maps apply one per-channel scale and shift in float.
#include "chorus/cpu/batch_norm.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "chorus/cpu/parallel.h"

namespace chorus::cpu {
namespace {

// A share of work for the CPU pool covers at least this many floats of x.
constexpr int64_t kMinFloatsPerShare = int64_t{1} << 15;

void check_sizes(const char* kernel, int64_t n, int64_t c, int64_t h, int64_t w) {
  if (n < 0 || c < 1 || h < 1 || w < 1) {
    throw std::invalid_argument(
        std::string(kernel) +
        ": input must have n >= 0 and c, h, w >= 1 (got n=" + std::to_string(n) +
        ", c=" + std::to_string(c) + ", h=" + std::to_string(h) + ", w=" + std::to_string(w) + ")");
  }
}

// Runs fn(ch) for every channel, channels split over the CPU pool.
template <typename F>
void for_each_channel(int64_t n, int64_t c, int64_t hw, F&& fn) {
  const int64_t per_channel = std::max<int64_t>(1, n * hw);
  parallel_for(c, std::max<int64_t>(1, kMinFloatsPerShare / per_channel),
               [&](int64_t c0, int64_t c1) {
                 for (int64_t ch = c0; ch < c1; ++ch) fn(ch);
               });
}

// Sum in double of term(plane_pointer..., i) over channel ch's n planes.
// Eight independent accumulators let the compiler vectorise without
// reassociating (and keep the sum accurate).
template <typename Term>
double channel_sum(int64_t n, int64_t c, int64_t hw, int64_t ch, Term term) {
  double acc[8] = {};
  double tail = 0.0;
  for (int64_t b = 0; b < n; ++b) {
    const int64_t base = (b * c + ch) * hw;
    int64_t i = 0;
    for (; i + 8 <= hw; i += 8)
      for (int j = 0; j < 8; ++j) acc[j] += term(base + i + j);
    for (; i < hw; ++i) tail += term(base + i);
  }
  for (double a : acc) tail += a;
  return tail;
}

// out = (in - center) * scale + shift over channel ch. Centering first keeps
// a large mean from cancelling away the result's low digits.
void channel_affine(const float* in, int64_t n, int64_t c, int64_t hw, int64_t ch, float center,
                    float scale, float shift, float* out) {
  for (int64_t b = 0; b < n; ++b) {
    const int64_t base = (b * c + ch) * hw;
    for (int64_t i = 0; i < hw; ++i) out[base + i] = (in[base + i] - center) * scale + shift;
  }
}

}  // namespace

void batch_norm_forward_train(const float* x, int64_t n, int64_t c, int64_t h, int64_t w,
                              const float* gamma, const float* beta, float eps, float momentum,
                              float* running_mean, float* running_var, float* y, float* save_mean,
                              float* save_invstd) {
  check_sizes("batch_norm_forward_train", n, c, h, w);
  const int64_t hw = h * w, count = n * hw;
  if (count < 2) {
    throw std::invalid_argument(
        "batch_norm_forward_train: expected more than 1 value per channel when training (n=" +
        std::to_string(n) + ", h=" + std::to_string(h) + ", w=" + std::to_string(w) + ")");
  }
  for_each_channel(n, c, hw, [&](int64_t ch) {
    // Two passes (mean, then squared deviations): no cancellation for
    // channels whose mean is large against their spread.
    const double mean = channel_sum(n, c, hw, ch, [&](int64_t i) { return double(x[i]); }) / count;
    const double var = channel_sum(n, c, hw, ch,
                                   [&](int64_t i) {
                                     const double d = x[i] - mean;
                                     return d * d;
                                   }) /
                       count;
    const double invstd = 1.0 / std::sqrt(var + double(eps));
    save_mean[ch] = static_cast<float>(mean);
    save_invstd[ch] = static_cast<float>(invstd);
    if (running_mean) {
      running_mean[ch] = static_cast<float>((1.0 - momentum) * running_mean[ch] + momentum * mean);
    }
    if (running_var) {
      const double unbiased = var * double(count) / double(count - 1);
      running_var[ch] =
          static_cast<float>((1.0 - momentum) * running_var[ch] + momentum * unbiased);
    }
    const double scale = invstd * (gamma ? gamma[ch] : 1.0);
    channel_affine(x, n, c, hw, ch, save_mean[ch], static_cast<float>(scale),
                   beta ? beta[ch] : 0.0f, y);
  });
}

void batch_norm_forward_eval(const float* x, int64_t n, int64_t c, int64_t h, int64_t w,
                             const float* gamma, const float* beta, const float* running_mean,
                             const float* running_var, float eps, float* y) {
  check_sizes("batch_norm_forward_eval", n, c, h, w);
  const int64_t hw = h * w;
  for_each_channel(n, c, hw, [&](int64_t ch) {
    const double invstd = 1.0 / std::sqrt(double(running_var[ch]) + double(eps));
    const double scale = invstd * (gamma ? gamma[ch] : 1.0);
    channel_affine(x, n, c, hw, ch, running_mean[ch], static_cast<float>(scale),
                   beta ? beta[ch] : 0.0f, y);
  });
}

void batch_norm_backward(const float* dy, const float* x, int64_t n, int64_t c, int64_t h,
                         int64_t w, const float* gamma, const float* save_mean,
                         const float* save_invstd, float* dx, float* dgamma, float* dbeta) {
  check_sizes("batch_norm_backward", n, c, h, w);
  const int64_t hw = h * w, count = n * hw;
  for_each_channel(n, c, hw, [&](int64_t ch) {
    const double mean = save_mean[ch], invstd = save_invstd[ch];
    const double sum_dy = channel_sum(n, c, hw, ch, [&](int64_t i) { return double(dy[i]); });
    // sum(dy * (x - mean)); times invstd it is sum(dy * xhat).
    const double sum_dy_xc =
        channel_sum(n, c, hw, ch, [&](int64_t i) { return double(dy[i]) * (x[i] - mean); });
    if (dgamma) dgamma[ch] = static_cast<float>(sum_dy_xc * invstd);
    if (dbeta) dbeta[ch] = static_cast<float>(sum_dy);
    if (!dx || count == 0) return;
    // dx = k * (dy - mean(dy) - (x - mean) * proj), k = gamma * invstd,
    // proj = invstd^2 * mean(dy * (x - mean)). x - mean is formed in float
    // before scaling so a large mean does not cancel away the signal.
    const double k = (gamma ? gamma[ch] : 1.0) * invstd;
    const double proj = invstd * invstd * sum_dy_xc / count;
    const auto a = static_cast<float>(k);
    const auto bx = static_cast<float>(-k * proj);
    const auto d = static_cast<float>(-k * sum_dy / count);
    const auto mean_f = static_cast<float>(mean);
    for (int64_t b = 0; b < n; ++b) {
      const int64_t base = (b * c + ch) * hw;
      for (int64_t i = 0; i < hw; ++i) {
        dx[base + i] = a * dy[base + i] + bx * (x[base + i] - mean_f) + d;
      }
    }
  });
}

void batch_norm_backward_eval(const float* dy, const float* x, int64_t n, int64_t c, int64_t h,
                              int64_t w, const float* gamma, const float* running_mean,
                              const float* running_var, float eps, float* dx, float* dgamma,
                              float* dbeta) {
  check_sizes("batch_norm_backward_eval", n, c, h, w);
  const int64_t hw = h * w;
  for_each_channel(n, c, hw, [&](int64_t ch) {
    const double mean = running_mean[ch];
    const double invstd = 1.0 / std::sqrt(double(running_var[ch]) + double(eps));
    if (dgamma) {
      dgamma[ch] = static_cast<float>(invstd * channel_sum(n, c, hw, ch, [&](int64_t i) {
                                        return double(dy[i]) * (x[i] - mean);
                                      }));
    }
    if (dbeta) {
      dbeta[ch] =
          static_cast<float>(channel_sum(n, c, hw, ch, [&](int64_t i) { return double(dy[i]); }));
    }
    if (dx) {
      const auto scale = static_cast<float>((gamma ? gamma[ch] : 1.0) * invstd);
      channel_affine(dy, n, c, hw, ch, 0.0f, scale, 0.0f, dx);
    }
  });
}

}  // namespace chorus::cpu
