// See nn_kernels_f64.h. Every kernel is the textbook loop nest over its
// definition; the backward passes walk the same nests as their forwards and
// scatter, so each is visibly the adjoint of the other.
#include "chorus/cpu/nn_kernels_f64.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace chorus::cpu::f64 {
namespace {

std::string v(int64_t a) { return std::to_string(a); }

[[noreturn]] void fail(const char* kernel, const std::string& why) {
  throw std::invalid_argument(std::string(kernel) + ": " + why);
}

void check_planes(const char* kernel, int64_t n, int64_t c, int64_t h, int64_t w) {
  if (n < 0 || c < 1 || h < 1 || w < 1)
    fail(kernel, "input must have n >= 0 and c, h, w >= 1 (got n=" + v(n) + ", c=" + v(c) +
                     ", h=" + v(h) + ", w=" + v(w) + ")");
}

// The one pooling rule the caller's pool_out_size does not check.
void check_pool_padding(const char* kernel, int64_t kh, int64_t kw, int64_t ph, int64_t pw) {
  if (ph > kh / 2 || pw > kw / 2)
    fail(kernel, "padding must be at most half the kernel (kernel=" + v(kh) + "x" + v(kw) +
                     ", pad=" + v(ph) + "x" + v(pw) + ")");
}

int64_t out_size(int64_t in, int64_t kernel, int64_t stride, int64_t pad) {
  return (in + 2 * pad - kernel) / stride + 1;
}

// Calls fn(dy_or_y_index, x_index, weight_index) for every (output, tap) pair
// of the convolution whose tap lands inside the input (padding contributes 0).
template <typename F>
void for_each_conv_tap(const Conv2dShape& s, F&& fn) {
  const int64_t oh = s.out_h(), ow = s.out_w();
  const int64_t cin_g = s.c_in / s.groups, cout_g = s.c_out / s.groups;
  for (int64_t b = 0; b < s.n; ++b)
    for (int64_t oc = 0; oc < s.c_out; ++oc) {
      const int64_t first_ic = (oc / cout_g) * cin_g;
      for (int64_t oy = 0; oy < oh; ++oy)
        for (int64_t ox = 0; ox < ow; ++ox) {
          const int64_t yi = ((b * s.c_out + oc) * oh + oy) * ow + ox;
          for (int64_t ic = 0; ic < cin_g; ++ic)
            for (int64_t ky = 0; ky < s.kh; ++ky) {
              const int64_t iy = oy * s.stride_h - s.pad_h + ky * s.dil_h;
              if (iy < 0 || iy >= s.h) continue;
              for (int64_t kx = 0; kx < s.kw; ++kx) {
                const int64_t ix = ox * s.stride_w - s.pad_w + kx * s.dil_w;
                if (ix < 0 || ix >= s.w) continue;
                const int64_t xi = ((b * s.c_in + first_ic + ic) * s.h + iy) * s.w + ix;
                const int64_t wi = ((oc * cin_g + ic) * s.kh + ky) * s.kw + kx;
                fn(yi, xi, wi);
              }
            }
        }
    }
}

// Calls fn(plane, y_index_in_plane, y0, y1, x0, x1, divisor) for every output
// of an average pool with count_include_pad (the divisor counts the window
// clipped to the padded input, as pool.cpp).
template <typename F>
void for_each_avg_window(int64_t planes, int64_t h, int64_t w, int64_t kh, int64_t kw, int64_t sh,
                         int64_t sw, int64_t ph, int64_t pw, F&& fn) {
  const int64_t oh = out_size(h, kh, sh, ph), ow = out_size(w, kw, sw, pw);
  for (int64_t p = 0; p < planes; ++p)
    for (int64_t oy = 0; oy < oh; ++oy) {
      const int64_t ys = oy * sh - ph, ye = std::min(ys + kh, h + ph);
      for (int64_t ox = 0; ox < ow; ++ox) {
        const int64_t xs = ox * sw - pw, xe = std::min(xs + kw, w + pw);
        fn(p, oy * ow + ox, std::max<int64_t>(ys, 0), std::min(ye, h), std::max<int64_t>(xs, 0),
           std::min(xe, w), double((ye - ys) * (xe - xs)));
      }
    }
}

// Same shape of callback for adaptive average pooling's windows.
template <typename F>
void for_each_adaptive_window(int64_t planes, int64_t h, int64_t w, int64_t oh, int64_t ow,
                              F&& fn) {
  for (int64_t p = 0; p < planes; ++p)
    for (int64_t oy = 0; oy < oh; ++oy) {
      const int64_t y0 = oy * h / oh, y1 = ((oy + 1) * h + oh - 1) / oh;
      for (int64_t ox = 0; ox < ow; ++ox) {
        const int64_t x0 = ox * w / ow, x1 = ((ox + 1) * w + ow - 1) / ow;
        fn(p, oy * ow + ox, y0, y1, x0, x1, double((y1 - y0) * (x1 - x0)));
      }
    }
}

void check_adaptive(const char* kernel, int64_t n, int64_t c, int64_t h, int64_t w, int64_t oh,
                    int64_t ow) {
  check_planes(kernel, n, c, h, w);
  if (oh < 1 || ow < 1)
    fail(kernel, "output size must be >= 1 (got " + v(oh) + "x" + v(ow) + ")");
}

// Element i of channel ch, plane b, in [n, c, hw].
int64_t at(int64_t b, int64_t ch, int64_t i, int64_t c, int64_t hw) {
  return (b * c + ch) * hw + i;
}

}  // namespace

// ---- convolution -------------------------------------------------------------------

void conv2d_forward(const Conv2dShape& s, const double* x, const double* weight,
                    const double* bias, double* y) {
  const int64_t plane = s.out_h() * s.out_w();
  for (int64_t b = 0; b < s.n; ++b)
    for (int64_t oc = 0; oc < s.c_out; ++oc)
      std::fill_n(y + (b * s.c_out + oc) * plane, plane, bias ? bias[oc] : 0.0);
  for_each_conv_tap(s, [&](int64_t yi, int64_t xi, int64_t wi) { y[yi] += x[xi] * weight[wi]; });
}

void conv2d_backward_input(const Conv2dShape& s, const double* dy, const double* weight,
                           double* dx) {
  std::fill_n(dx, s.n * s.c_in * s.h * s.w, 0.0);
  for_each_conv_tap(s, [&](int64_t yi, int64_t xi, int64_t wi) { dx[xi] += dy[yi] * weight[wi]; });
}

void conv2d_backward_weight(const Conv2dShape& s, const double* dy, const double* x,
                            double* dweight, double* dbias) {
  std::fill_n(dweight, s.c_out * (s.c_in / s.groups) * s.kh * s.kw, 0.0);
  for_each_conv_tap(s, [&](int64_t yi, int64_t xi, int64_t wi) { dweight[wi] += dy[yi] * x[xi]; });
  if (!dbias) return;
  const int64_t plane = s.out_h() * s.out_w();
  for (int64_t oc = 0; oc < s.c_out; ++oc) {
    double sum = 0.0;
    for (int64_t b = 0; b < s.n; ++b)
      for (int64_t i = 0; i < plane; ++i) sum += dy[(b * s.c_out + oc) * plane + i];
    dbias[oc] = sum;
  }
}

// ---- pooling -------------------------------------------------------------------------

void max_pool2d_forward(const double* x, int64_t n, int64_t c, int64_t h, int64_t w,
                        int64_t kernel_h, int64_t kernel_w, int64_t stride_h, int64_t stride_w,
                        int64_t pad_h, int64_t pad_w, double* y, int64_t* indices) {
  check_planes("max_pool2d_forward", n, c, h, w);
  check_pool_padding("max_pool2d_forward", kernel_h, kernel_w, pad_h, pad_w);
  const int64_t oh = out_size(h, kernel_h, stride_h, pad_h);
  const int64_t ow = out_size(w, kernel_w, stride_w, pad_w);
  for (int64_t p = 0; p < n * c; ++p)
    for (int64_t oy = 0; oy < oh; ++oy) {
      const int64_t y0 = std::max<int64_t>(oy * stride_h - pad_h, 0);
      const int64_t y1 = std::min(oy * stride_h - pad_h + kernel_h, h);
      for (int64_t ox = 0; ox < ow; ++ox) {
        const int64_t x0 = std::max<int64_t>(ox * stride_w - pad_w, 0);
        const int64_t x1 = std::min(ox * stride_w - pad_w + kernel_w, w);
        // pool.cpp's rule: the first maximum wins, and a NaN always wins.
        double best = -std::numeric_limits<double>::infinity();
        int64_t best_at = y0 * w + x0;
        for (int64_t iy = y0; iy < y1; ++iy)
          for (int64_t ix = x0; ix < x1; ++ix) {
            const double val = x[p * h * w + iy * w + ix];
            if (val > best || std::isnan(val)) {
              best = val;
              best_at = iy * w + ix;
            }
          }
        y[(p * oh + oy) * ow + ox] = best;
        indices[(p * oh + oy) * ow + ox] = best_at;
      }
    }
}

void max_pool2d_backward(const double* dy, const int64_t* indices, int64_t n, int64_t c,
                         int64_t h, int64_t w, int64_t out_h, int64_t out_w, double* dx) {
  check_planes("max_pool2d_backward", n, c, h, w);
  const int64_t plane = h * w, out_plane = out_h * out_w;
  std::fill_n(dx, n * c * plane, 0.0);
  for (int64_t p = 0; p < n * c; ++p)
    for (int64_t o = 0; o < out_plane; ++o) {
      const int64_t i = indices[p * out_plane + o];
      if (i < 0 || i >= plane)
        fail("max_pool2d_backward",
             "index " + v(i) + " outside the " + v(h) + "x" + v(w) + " input plane");
      dx[p * plane + i] += dy[p * out_plane + o];
    }
}

void avg_pool2d_forward(const double* x, int64_t n, int64_t c, int64_t h, int64_t w,
                        int64_t kernel_h, int64_t kernel_w, int64_t stride_h, int64_t stride_w,
                        int64_t pad_h, int64_t pad_w, double* y) {
  check_planes("avg_pool2d_forward", n, c, h, w);
  check_pool_padding("avg_pool2d_forward", kernel_h, kernel_w, pad_h, pad_w);
  const int64_t out_plane = out_size(h, kernel_h, stride_h, pad_h) *
                            out_size(w, kernel_w, stride_w, pad_w);
  for_each_avg_window(n * c, h, w, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w,
                      [&](int64_t p, int64_t o, int64_t y0, int64_t y1, int64_t x0, int64_t x1,
                          double divisor) {
                        double sum = 0.0;
                        for (int64_t iy = y0; iy < y1; ++iy)
                          for (int64_t ix = x0; ix < x1; ++ix) sum += x[p * h * w + iy * w + ix];
                        y[p * out_plane + o] = sum / divisor;
                      });
}

void avg_pool2d_backward(const double* dy, int64_t n, int64_t c, int64_t h, int64_t w,
                         int64_t kernel_h, int64_t kernel_w, int64_t stride_h, int64_t stride_w,
                         int64_t pad_h, int64_t pad_w, double* dx) {
  check_planes("avg_pool2d_backward", n, c, h, w);
  check_pool_padding("avg_pool2d_backward", kernel_h, kernel_w, pad_h, pad_w);
  const int64_t out_plane = out_size(h, kernel_h, stride_h, pad_h) *
                            out_size(w, kernel_w, stride_w, pad_w);
  std::fill_n(dx, n * c * h * w, 0.0);
  for_each_avg_window(n * c, h, w, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w,
                      [&](int64_t p, int64_t o, int64_t y0, int64_t y1, int64_t x0, int64_t x1,
                          double divisor) {
                        const double share = dy[p * out_plane + o] / divisor;
                        for (int64_t iy = y0; iy < y1; ++iy)
                          for (int64_t ix = x0; ix < x1; ++ix) dx[p * h * w + iy * w + ix] += share;
                      });
}

void adaptive_avg_pool2d_forward(const double* x, int64_t n, int64_t c, int64_t h, int64_t w,
                                 int64_t out_h, int64_t out_w, double* y) {
  check_adaptive("adaptive_avg_pool2d_forward", n, c, h, w, out_h, out_w);
  for_each_adaptive_window(n * c, h, w, out_h, out_w,
                           [&](int64_t p, int64_t o, int64_t y0, int64_t y1, int64_t x0,
                               int64_t x1, double divisor) {
                             double sum = 0.0;
                             for (int64_t iy = y0; iy < y1; ++iy)
                               for (int64_t ix = x0; ix < x1; ++ix)
                                 sum += x[p * h * w + iy * w + ix];
                             y[p * out_h * out_w + o] = sum / divisor;
                           });
}

void adaptive_avg_pool2d_backward(const double* dy, int64_t n, int64_t c, int64_t h, int64_t w,
                                  int64_t out_h, int64_t out_w, double* dx) {
  check_adaptive("adaptive_avg_pool2d_backward", n, c, h, w, out_h, out_w);
  std::fill_n(dx, n * c * h * w, 0.0);
  for_each_adaptive_window(n * c, h, w, out_h, out_w,
                           [&](int64_t p, int64_t o, int64_t y0, int64_t y1, int64_t x0,
                               int64_t x1, double divisor) {
                             const double share = dy[p * out_h * out_w + o] / divisor;
                             for (int64_t iy = y0; iy < y1; ++iy)
                               for (int64_t ix = x0; ix < x1; ++ix)
                                 dx[p * h * w + iy * w + ix] += share;
                           });
}

// ---- batch norm ------------------------------------------------------------------------

void batch_norm_forward_train(const double* x, int64_t n, int64_t c, int64_t h, int64_t w,
                              const double* gamma, const double* beta, double eps,
                              double momentum, double* running_mean, double* running_var,
                              double* y, double* save_mean, double* save_invstd) {
  check_planes("batch_norm_forward_train", n, c, h, w);
  const int64_t hw = h * w, count = n * hw;
  if (count < 2)
    fail("batch_norm_forward_train",
         "expected more than 1 value per channel when training (n=" + v(n) + ", h=" + v(h) +
             ", w=" + v(w) + ")");
  for (int64_t ch = 0; ch < c; ++ch) {
    double mean = 0.0, var = 0.0;
    for (int64_t b = 0; b < n; ++b)
      for (int64_t i = 0; i < hw; ++i) mean += x[at(b, ch, i, c, hw)];
    mean /= double(count);
    for (int64_t b = 0; b < n; ++b)
      for (int64_t i = 0; i < hw; ++i) {
        const double d = x[at(b, ch, i, c, hw)] - mean;
        var += d * d;
      }
    var /= double(count);  // biased: what normalises
    const double invstd = 1.0 / std::sqrt(var + eps);
    save_mean[ch] = mean;
    save_invstd[ch] = invstd;
    if (running_mean) running_mean[ch] = (1.0 - momentum) * running_mean[ch] + momentum * mean;
    if (running_var) {
      const double unbiased = var * double(count) / double(count - 1);
      running_var[ch] = (1.0 - momentum) * running_var[ch] + momentum * unbiased;
    }
    const double g = gamma ? gamma[ch] : 1.0, sh = beta ? beta[ch] : 0.0;
    for (int64_t b = 0; b < n; ++b)
      for (int64_t i = 0; i < hw; ++i) {
        const int64_t k = at(b, ch, i, c, hw);
        y[k] = (x[k] - mean) * invstd * g + sh;
      }
  }
}

void batch_norm_forward_eval(const double* x, int64_t n, int64_t c, int64_t h, int64_t w,
                             const double* gamma, const double* beta, const double* running_mean,
                             const double* running_var, double eps, double* y) {
  check_planes("batch_norm_forward_eval", n, c, h, w);
  const int64_t hw = h * w;
  for (int64_t ch = 0; ch < c; ++ch) {
    const double invstd = 1.0 / std::sqrt(running_var[ch] + eps);
    const double g = gamma ? gamma[ch] : 1.0, sh = beta ? beta[ch] : 0.0;
    for (int64_t b = 0; b < n; ++b)
      for (int64_t i = 0; i < hw; ++i) {
        const int64_t k = at(b, ch, i, c, hw);
        y[k] = (x[k] - running_mean[ch]) * invstd * g + sh;
      }
  }
}

// dx = gamma * invstd * (dy - mean(dy) - xhat * mean(dy * xhat)),
// dgamma = sum(dy * xhat), dbeta = sum(dy), xhat = (x - mean) * invstd.
void batch_norm_backward(const double* dy, const double* x, int64_t n, int64_t c, int64_t h,
                         int64_t w, const double* gamma, const double* save_mean,
                         const double* save_invstd, double* dx, double* dgamma, double* dbeta) {
  check_planes("batch_norm_backward", n, c, h, w);
  const int64_t hw = h * w, count = n * hw;
  for (int64_t ch = 0; ch < c; ++ch) {
    const double mean = save_mean[ch], invstd = save_invstd[ch];
    double sum_dy = 0.0, sum_dy_xhat = 0.0;
    for (int64_t b = 0; b < n; ++b)
      for (int64_t i = 0; i < hw; ++i) {
        const int64_t k = at(b, ch, i, c, hw);
        sum_dy += dy[k];
        sum_dy_xhat += dy[k] * (x[k] - mean) * invstd;
      }
    if (dgamma) dgamma[ch] = sum_dy_xhat;
    if (dbeta) dbeta[ch] = sum_dy;
    if (!dx || count == 0) continue;
    const double k_scale = (gamma ? gamma[ch] : 1.0) * invstd;
    const double mean_dy = sum_dy / double(count), mean_dy_xhat = sum_dy_xhat / double(count);
    for (int64_t b = 0; b < n; ++b)
      for (int64_t i = 0; i < hw; ++i) {
        const int64_t k = at(b, ch, i, c, hw);
        const double xhat = (x[k] - mean) * invstd;
        dx[k] = k_scale * (dy[k] - mean_dy - xhat * mean_dy_xhat);
      }
  }
}

}  // namespace chorus::cpu::f64
