// See pool.h. Window arithmetic is PyTorch's (aten/src/ATen/native/cpu
// pooling kernels), so the divisor and argmax tie-breaking match it.
#include "chorus/cpu/pool.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "chorus/cpu/parallel.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace chorus::cpu {
namespace {

// A share of work for the CPU pool is at least this many floats of input.
constexpr int64_t kMinFloatsPerShare = int64_t{1} << 15;

int64_t plane_grain(int64_t plane) {
  return std::max<int64_t>(1, kMinFloatsPerShare / std::max<int64_t>(1, plane));
}

std::string v(int64_t a) { return std::to_string(a); }

[[noreturn]] void fail(const char* kernel, const std::string& why) {
  throw std::invalid_argument(std::string(kernel) + ": " + why);
}

void check_input(const char* kernel, int64_t n, int64_t c, int64_t h, int64_t w) {
  if (n < 0 || c < 1 || h < 1 || w < 1)
    fail(kernel, "input must have n >= 0 and c, h, w >= 1 (got n=" + v(n) + ", c=" + v(c) +
                     ", h=" + v(h) + ", w=" + v(w) + ")");
}

struct Out {
  int64_t h, w;
};

// Checks one kernel's parameters the way PyTorch does and returns the output size.
Out check_window(const char* kernel, int64_t n, int64_t c, int64_t h, int64_t w, int64_t kh,
                 int64_t kw, int64_t sh, int64_t sw, int64_t ph, int64_t pw) {
  check_input(kernel, n, c, h, w);
  const std::string params = " (kernel=" + v(kh) + "x" + v(kw) + ", stride=" + v(sh) + "x" + v(sw) +
                             ", pad=" + v(ph) + "x" + v(pw) + ", input=" + v(h) + "x" + v(w) + ")";
  if (kh < 1 || kw < 1 || sh < 1 || sw < 1 || ph < 0 || pw < 0)
    fail(kernel, "kernel and stride must be >= 1 and padding >= 0" + params);
  if (ph > kh / 2 || pw > kw / 2) fail(kernel, "padding must be at most half the kernel" + params);
  if (h + 2 * ph < kh || w + 2 * pw < kw)
    fail(kernel, "kernel is larger than the padded input" + params);
  return {pool_out_size(h, kh, sh, ph), pool_out_size(w, kw, sw, pw)};
}

// PyTorch's adaptive window: [floor(i*in/out), ceil((i+1)*in/out)).
int64_t adaptive_begin(int64_t i, int64_t in, int64_t out) { return (i * in) / out; }
int64_t adaptive_end(int64_t i, int64_t in, int64_t out) { return ((i + 1) * in + out - 1) / out; }

void check_adaptive(const char* kernel, int64_t n, int64_t c, int64_t h, int64_t w, int64_t out_h,
                    int64_t out_w) {
  check_input(kernel, n, c, h, w);
  if (out_h < 1 || out_w < 1)
    fail(kernel, "output size must be >= 1 (got " + v(out_h) + "x" + v(out_w) + ")");
}

#if defined(__SSE2__)
// The 2x2 stride-2 window, four outputs at a time: the even and odd columns of
// two input rows are split with shuffles, and the same select rule as the
// scalar loop (a larger value or a NaN takes the place) runs on four lanes.
// Returns the first output column it did not do.
int64_t max_pool_2x2_sse(const float* __restrict r0, const float* __restrict r1, int64_t out_w, int64_t w,
                         int64_t base, float* __restrict orow, int64_t* __restrict irow) {
  int64_t ox = 0;
  for (; ox + 4 <= out_w; ox += 4) {
    const __m128 r0a = _mm_loadu_ps(r0 + 2 * ox), r0b = _mm_loadu_ps(r0 + 2 * ox + 4);
    const __m128 r1a = _mm_loadu_ps(r1 + 2 * ox), r1b = _mm_loadu_ps(r1 + 2 * ox + 4);
    const __m128 lanes[3] = {_mm_shuffle_ps(r0a, r0b, _MM_SHUFFLE(3, 1, 3, 1)),
                             _mm_shuffle_ps(r1a, r1b, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm_shuffle_ps(r1a, r1b, _MM_SHUFFLE(3, 1, 3, 1))};
    __m128 best = _mm_shuffle_ps(r0a, r0b, _MM_SHUFFLE(2, 0, 2, 0));
    __m128i k = _mm_setzero_si128();
    for (int j = 0; j < 3; ++j) {
      const __m128 v = lanes[j];
      const __m128 take = _mm_or_ps(_mm_cmpgt_ps(v, best), _mm_cmpunord_ps(v, v));
      best = _mm_or_ps(_mm_and_ps(take, v), _mm_andnot_ps(take, best));
      const __m128i t = _mm_castps_si128(take);
      k = _mm_or_si128(_mm_and_si128(t, _mm_set1_epi32(j + 1)), _mm_andnot_si128(t, k));
    }
    _mm_storeu_ps(orow + ox, best);
    alignas(16) int32_t kk[4];
    _mm_store_si128(reinterpret_cast<__m128i*>(kk), k);
    for (int j = 0; j < 4; ++j) irow[ox + j] = base + 2 * (ox + j) + (kk[j] & 1) + (kk[j] >> 1) * w;
  }
  return ox;
}
#endif

}  // namespace

int64_t pool_out_size(int64_t in, int64_t kernel, int64_t stride, int64_t pad) {
  if (in < 1 || kernel < 1 || stride < 1 || pad < 0 || in + 2 * pad < kernel) {
    fail("pool_out_size", "no window fits (in=" + v(in) + ", kernel=" + v(kernel) +
                              ", stride=" + v(stride) + ", pad=" + v(pad) + ")");
  }
  return (in + 2 * pad - kernel) / stride + 1;
}

void max_pool2d_forward(const float* x, int64_t n, int64_t c, int64_t h, int64_t w,
                        int64_t kernel_h, int64_t kernel_w, int64_t stride_h, int64_t stride_w,
                        int64_t pad_h, int64_t pad_w, float* y, int64_t* indices) {
  const Out o = check_window("max_pool2d_forward", n, c, h, w, kernel_h, kernel_w, stride_h,
                             stride_w, pad_h, pad_w);
  // 2x2 windows at stride 2 without padding (every CNN's pooling): the four
  // values compared with selects, not branches, which random data mispredict
  // half the time. Same rule: a larger value or a NaN takes the place.
  const bool two_by_two = kernel_h == 2 && kernel_w == 2 && stride_h == 2 && stride_w == 2 && pad_h == 0 &&
                          pad_w == 0;
  parallel_for(n * c, plane_grain(h * w), [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const float* in = x + p * h * w;
      float* out = y + p * o.h * o.w;
      int64_t* idx = indices + p * o.h * o.w;
      if (two_by_two) {
        for (int64_t oy = 0; oy < o.h; ++oy) {
          const float* __restrict r0 = in + 2 * oy * w;
          const float* __restrict r1 = r0 + w;
          float* __restrict orow = out + oy * o.w;
          int64_t* __restrict irow = idx + oy * o.w;
          const int64_t base = 2 * oy * w;
          int64_t ox = 0;
#if defined(__SSE2__)
          ox = max_pool_2x2_sse(r0, r1, o.w, w, base, orow, irow);
#endif
          for (; ox < o.w; ++ox) {
            const float a = r0[2 * ox], b = r0[2 * ox + 1], c = r1[2 * ox], d = r1[2 * ox + 1];
            // Position within the window (0..3) first, as a small integer the
            // selects carry cheaply; the flat index from it after.
            float best = a;
            int64_t k = 0;
            bool take = b > best || b != b;
            best = take ? b : best;
            k = take ? 1 : k;
            take = c > best || c != c;
            best = take ? c : best;
            k = take ? 2 : k;
            take = d > best || d != d;
            best = take ? d : best;
            k = take ? 3 : k;
            orow[ox] = best;
            irow[ox] = base + 2 * ox + (k & 1) + (k >> 1) * w;
          }
        }
        continue;
      }
      for (int64_t oy = 0; oy < o.h; ++oy) {
        const int64_t y0 = std::max<int64_t>(oy * stride_h - pad_h, 0);
        const int64_t y1 = std::min(oy * stride_h - pad_h + kernel_h, h);
        for (int64_t ox = 0; ox < o.w; ++ox) {
          const int64_t x0 = std::max<int64_t>(ox * stride_w - pad_w, 0);
          const int64_t x1 = std::min(ox * stride_w - pad_w + kernel_w, w);
          float best = -std::numeric_limits<float>::infinity();
          int64_t best_at = y0 * w + x0;
          for (int64_t iy = y0; iy < y1; ++iy) {
            for (int64_t ix = x0; ix < x1; ++ix) {
              const float val = in[iy * w + ix];
              // NaN wins, as in PyTorch: a NaN input must not vanish.
              if (val > best || std::isnan(val)) {
                best = val;
                best_at = iy * w + ix;
              }
            }
          }
          out[oy * o.w + ox] = best;
          idx[oy * o.w + ox] = best_at;
        }
      }
    }
  });
}

void max_pool2d_backward(const float* dy, const int64_t* indices, int64_t n, int64_t c, int64_t h,
                         int64_t w, int64_t out_h, int64_t out_w, float* dx) {
  check_input("max_pool2d_backward", n, c, h, w);
  if (out_h < 1 || out_w < 1)
    fail("max_pool2d_backward", "output size must be >= 1 (got " + v(out_h) + "x" + v(out_w) + ")");
  const int64_t plane = h * w, out_plane = out_h * out_w;
  parallel_for(n * c, plane_grain(plane), [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      float* g = dx + p * plane;
      std::fill(g, g + plane, 0.0f);
      const float* d = dy + p * out_plane;
      const int64_t* idx = indices + p * out_plane;
      for (int64_t o = 0; o < out_plane; ++o) {
        if (idx[o] < 0 || idx[o] >= plane) {
          fail("max_pool2d_backward",
               "index " + v(idx[o]) + " outside the " + v(h) + "x" + v(w) + " input plane");
        }
        g[idx[o]] += d[o];
      }
    }
  });
}

void avg_pool2d_forward(const float* x, int64_t n, int64_t c, int64_t h, int64_t w,
                        int64_t kernel_h, int64_t kernel_w, int64_t stride_h, int64_t stride_w,
                        int64_t pad_h, int64_t pad_w, float* y) {
  const Out o = check_window("avg_pool2d_forward", n, c, h, w, kernel_h, kernel_w, stride_h,
                             stride_w, pad_h, pad_w);
  parallel_for(n * c, plane_grain(h * w), [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const float* in = x + p * h * w;
      float* out = y + p * o.h * o.w;
      for (int64_t oy = 0; oy < o.h; ++oy) {
        const int64_t ys = oy * stride_h - pad_h;
        const int64_t ye = std::min(ys + kernel_h, h + pad_h);
        const int64_t y0 = std::max<int64_t>(ys, 0), y1 = std::min(ye, h);
        for (int64_t ox = 0; ox < o.w; ++ox) {
          const int64_t xs = ox * stride_w - pad_w;
          const int64_t xe = std::min(xs + kernel_w, w + pad_w);
          const int64_t x0 = std::max<int64_t>(xs, 0), x1 = std::min(xe, w);
          // count_include_pad: the divisor is the window clipped to the
          // padded input, before clipping to the real one.
          const int64_t divisor = (ye - ys) * (xe - xs);
          float sum = 0.0f;
          for (int64_t iy = y0; iy < y1; ++iy)
            for (int64_t ix = x0; ix < x1; ++ix) sum += in[iy * w + ix];
          out[oy * o.w + ox] = sum / static_cast<float>(divisor);
        }
      }
    }
  });
}

void avg_pool2d_backward(const float* dy, int64_t n, int64_t c, int64_t h, int64_t w,
                         int64_t kernel_h, int64_t kernel_w, int64_t stride_h, int64_t stride_w,
                         int64_t pad_h, int64_t pad_w, float* dx) {
  const Out o = check_window("avg_pool2d_backward", n, c, h, w, kernel_h, kernel_w, stride_h,
                             stride_w, pad_h, pad_w);
  parallel_for(n * c, plane_grain(h * w), [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      float* g = dx + p * h * w;
      std::fill(g, g + h * w, 0.0f);
      const float* d = dy + p * o.h * o.w;
      for (int64_t oy = 0; oy < o.h; ++oy) {
        const int64_t ys = oy * stride_h - pad_h;
        const int64_t ye = std::min(ys + kernel_h, h + pad_h);
        const int64_t y0 = std::max<int64_t>(ys, 0), y1 = std::min(ye, h);
        for (int64_t ox = 0; ox < o.w; ++ox) {
          const int64_t xs = ox * stride_w - pad_w;
          const int64_t xe = std::min(xs + kernel_w, w + pad_w);
          const int64_t x0 = std::max<int64_t>(xs, 0), x1 = std::min(xe, w);
          const float share = d[oy * o.w + ox] / static_cast<float>((ye - ys) * (xe - xs));
          for (int64_t iy = y0; iy < y1; ++iy)
            for (int64_t ix = x0; ix < x1; ++ix) g[iy * w + ix] += share;
        }
      }
    }
  });
}

void adaptive_avg_pool2d_forward(const float* x, int64_t n, int64_t c, int64_t h, int64_t w,
                                 int64_t out_h, int64_t out_w, float* y) {
  check_adaptive("adaptive_avg_pool2d_forward", n, c, h, w, out_h, out_w);
  parallel_for(n * c, plane_grain(h * w), [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const float* in = x + p * h * w;
      float* out = y + p * out_h * out_w;
      for (int64_t oy = 0; oy < out_h; ++oy) {
        const int64_t y0 = adaptive_begin(oy, h, out_h), y1 = adaptive_end(oy, h, out_h);
        for (int64_t ox = 0; ox < out_w; ++ox) {
          const int64_t x0 = adaptive_begin(ox, w, out_w), x1 = adaptive_end(ox, w, out_w);
          float sum = 0.0f;
          for (int64_t iy = y0; iy < y1; ++iy)
            for (int64_t ix = x0; ix < x1; ++ix) sum += in[iy * w + ix];
          out[oy * out_w + ox] = sum / static_cast<float>((y1 - y0) * (x1 - x0));
        }
      }
    }
  });
}

void adaptive_avg_pool2d_backward(const float* dy, int64_t n, int64_t c, int64_t h, int64_t w,
                                  int64_t out_h, int64_t out_w, float* dx) {
  check_adaptive("adaptive_avg_pool2d_backward", n, c, h, w, out_h, out_w);
  parallel_for(n * c, plane_grain(h * w), [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      float* g = dx + p * h * w;
      std::fill(g, g + h * w, 0.0f);
      const float* d = dy + p * out_h * out_w;
      for (int64_t oy = 0; oy < out_h; ++oy) {
        const int64_t y0 = adaptive_begin(oy, h, out_h), y1 = adaptive_end(oy, h, out_h);
        for (int64_t ox = 0; ox < out_w; ++ox) {
          const int64_t x0 = adaptive_begin(ox, w, out_w), x1 = adaptive_end(ox, w, out_w);
          const float share = d[oy * out_w + ox] / static_cast<float>((y1 - y0) * (x1 - x0));
          for (int64_t iy = y0; iy < y1; ++iy)
            for (int64_t ix = x0; ix < x1; ++ix) g[iy * w + ix] += share;
        }
      }
    }
  });
}

}  // namespace chorus::cpu
