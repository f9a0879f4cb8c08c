// See conv2d.h for the layout. Per chunk of `nb` images:
//   forward:         col = im2col(x);  tmp = W_g * col_g;   y <- tmp (+ bias)
//   backward_input:  tmp <- dy;        col = W_g^T * tmp_g; dx = col2im(col)
//   backward_weight: col = im2col(x);  tmp <- dy;           dW_g += tmp_g * col_g^T
// where tmp is [c_out, nb*out_hw] (the chunk's channels side by side). With
// nb == 1 tmp is exactly one image of y / dy, so the copies are skipped.
//
// Threads: with two or more chunks, chunks run in parallel on the CPU pool,
// each with single-threaded GEMMs (SerialBlasScope). Measured on 2 cores this
// beats chunk-after-chunk with OpenBLAS threading each GEMM by 1.2-2x: the
// copies, a third of a small layer's time, run in parallel too. A batch that
// is one chunk keeps OpenBLAS threading and splits its copies over the pool.
#include "chorus/cpu/conv2d.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "chorus/cpu/gemm.h"
#include "chorus/cpu/parallel.h"

namespace chorus::cpu {
namespace {

// Columns (images * out_h * out_w) per chunk. Narrower GEMMs lose to
// per-call packing overhead, wider chunks fall out of cache; 1024 to 4096
// measured alike on the CNN layers of bench/cpu_kernels.
constexpr int64_t kTargetColumns = 2048;
// Upper bound on one chunk's im2col buffer (floats, 16 MiB per thread); it
// bounds the thread_local scratch. A single image may exceed it, and then
// goes alone.
constexpr int64_t kMaxChunkFloats = int64_t{4} << 20;

float* scratch(std::vector<float>& buf, int64_t floats) {
  if (static_cast<int64_t>(buf.size()) < floats) buf.resize(static_cast<size_t>(floats));
  return buf.data();
}

// Two separate buffers: col and tmp are alive at the same time.
float* col_scratch(int64_t floats) {
  thread_local std::vector<float> buf;
  return scratch(buf, floats);
}
float* tmp_scratch(int64_t floats) {
  thread_local std::vector<float> buf;
  return scratch(buf, floats);
}
// Per-thread weight-gradient partial sums of backward_weight.
float* partial_scratch(int64_t floats) {
  thread_local std::vector<float> buf;
  return scratch(buf, floats);
}

// When a batch is a single chunk, OpenBLAS threads its GEMM but not the
// copies around it (im2col, col2im, packing), so those are split over the
// CPU pool, by whole planes, when each share moves at least this many floats.
// (Inside a pool worker parallel_for runs inline.)
constexpr int64_t kMinFloatsPerShare = int64_t{1} << 15;

int64_t grain(int64_t floats_per_item) {
  return std::max<int64_t>(1, kMinFloatsPerShare / std::max<int64_t>(1, floats_per_item));
}

// Derived sizes used by every kernel.
struct Geometry {
  int64_t oh, ow, ohw, hw;
  int64_t cin_g, cout_g;  // channels per group
  int64_t k_g;            // GEMM inner size per group: cin_g * kh * kw
  int64_t k_all;          // im2col rows for all groups: c_in * kh * kw
  bool pointwise;         // 1x1, stride 1, no padding: x is its own im2col
  int64_t chunk;          // images per chunk
  int64_t chunks(int64_t n) const { return (n + chunk - 1) / chunk; }
};

Geometry geometry(const Conv2dShape& s) {
  Geometry g{};
  g.oh = s.out_h();
  g.ow = s.out_w();
  g.ohw = g.oh * g.ow;
  g.hw = s.h * s.w;
  g.cin_g = s.c_in / s.groups;
  g.cout_g = s.c_out / s.groups;
  g.k_g = g.cin_g * s.kh * s.kw;
  g.k_all = s.c_in * s.kh * s.kw;
  g.pointwise =
      s.kh == 1 && s.kw == 1 && s.stride_h == 1 && s.stride_w == 1 && s.pad_h == 0 && s.pad_w == 0;
  if (g.pointwise) {
    g.chunk = 1;  // each image is already its own column matrix
  } else {
    int64_t nb = (kTargetColumns + g.ohw - 1) / g.ohw;
    nb = std::min(nb, std::max<int64_t>(1, kMaxChunkFloats / (g.k_all * g.ohw)));
    nb = std::clamp<int64_t>(nb, 1, std::max<int64_t>(s.n, 1));
    // Round the chunk count up to a multiple of the thread count, so that no
    // thread idles while another finishes a last chunk.
    const int64_t threads = num_threads();
    int64_t chunks = (s.n + nb - 1) / nb;
    if (chunks > 1 && threads > 1) {
      chunks = (chunks + threads - 1) / threads * threads;
      nb = std::max<int64_t>(1, (s.n + chunks - 1) / chunks);
    }
    g.chunk = nb;
  }
  return g;
}

// For kernel column kj: output columns [lo, hi) read inside the input row;
// the rest read padding. Solves 0 <= ow*stride - pad + kj*dil < w for ow.
void valid_range(int64_t offset, int64_t stride, int64_t in, int64_t out, int64_t* lo,
                 int64_t* hi) {
  // offset = kj*dil - pad; need ow*stride + offset in [0, in).
  int64_t l = offset >= 0 ? 0 : (-offset + stride - 1) / stride;
  int64_t h = in - offset <= 0 ? 0 : (in - offset - 1) / stride + 1;
  *lo = std::min(l, out);
  *hi = std::clamp(h, *lo, out);
}

// col[r, b*ohw + p] for r over (ci, ki, kj) and images b in [0, nb). Work is
// split by input plane (b, ci): each reads one plane, hot in L1, and writes
// its kh*kw row segments.
void im2col(const Conv2dShape& s, const Geometry& g, const float* x, int64_t nb, float* col) {
  const int64_t ld = nb * g.ohw;
  parallel_for(nb * s.c_in, grain(s.kh * s.kw * g.ohw), [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t b = q / s.c_in, ci = q % s.c_in;
      const float* plane = x + q * g.hw;
      for (int64_t ki = 0; ki < s.kh; ++ki) {
        for (int64_t kj = 0; kj < s.kw; ++kj) {
          const int64_t off_w = kj * s.dil_w - s.pad_w;
          int64_t lo, hi;
          valid_range(off_w, s.stride_w, s.w, g.ow, &lo, &hi);
          float* dst = col + ((ci * s.kh + ki) * s.kw + kj) * ld + b * g.ohw;
          for (int64_t oy = 0; oy < g.oh; ++oy, dst += g.ow) {
            const int64_t iy = oy * s.stride_h - s.pad_h + ki * s.dil_h;
            if (iy < 0 || iy >= s.h) {
              std::fill(dst, dst + g.ow, 0.0f);
              continue;
            }
            const float* src = plane + iy * s.w + off_w;
            std::fill(dst, dst + lo, 0.0f);
            if (s.stride_w == 1) {
              std::memcpy(dst + lo, src + lo, static_cast<size_t>(hi - lo) * sizeof(float));
            } else {
              for (int64_t ox = lo; ox < hi; ++ox) dst[ox] = src[ox * s.stride_w];
            }
            std::fill(dst + hi, dst + g.ow, 0.0f);
          }
        }
      }
    }
  });
}

// dx = the adjoint of im2col: each input plane sums the col entries that were
// copied from it. Overwrites dx. Planes are disjoint, so they split freely.
void col2im(const Conv2dShape& s, const Geometry& g, const float* col, int64_t nb, float* dx) {
  const int64_t ld = nb * g.ohw;
  parallel_for(nb * s.c_in, grain(s.kh * s.kw * g.ohw), [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t b = q / s.c_in, ci = q % s.c_in;
      float* plane = dx + q * g.hw;
      std::fill(plane, plane + g.hw, 0.0f);
      for (int64_t ki = 0; ki < s.kh; ++ki) {
        for (int64_t kj = 0; kj < s.kw; ++kj) {
          const int64_t off_w = kj * s.dil_w - s.pad_w;
          int64_t lo, hi;
          valid_range(off_w, s.stride_w, s.w, g.ow, &lo, &hi);
          const float* src = col + ((ci * s.kh + ki) * s.kw + kj) * ld + b * g.ohw;
          for (int64_t oy = 0; oy < g.oh; ++oy, src += g.ow) {
            const int64_t iy = oy * s.stride_h - s.pad_h + ki * s.dil_h;
            if (iy < 0 || iy >= s.h) continue;
            float* dst = plane + iy * s.w + off_w;
            if (s.stride_w == 1) {
              for (int64_t ox = lo; ox < hi; ++ox) dst[ox] += src[ox];
            } else {
              for (int64_t ox = lo; ox < hi; ++ox) dst[ox * s.stride_w] += src[ox];
            }
          }
        }
      }
    }
  });
}

// tmp[c, b*plane + p] <- t[b, c, p] for nb images of `c` channels.
void pack_channels(const float* t, int64_t nb, int64_t c, int64_t plane, float* tmp) {
  const int64_t ld = nb * plane;
  parallel_for(nb * c, grain(plane), [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t b = q / c, ch = q % c;
      std::memcpy(tmp + ch * ld + b * plane, t + q * plane,
                  static_cast<size_t>(plane) * sizeof(float));
    }
  });
}

// y[b, c, p] = tmp[c, b*plane + p] + bias[c]; the inverse of pack_channels.
void unpack_channels(const float* tmp, const float* bias, int64_t nb, int64_t c, int64_t plane,
                     float* y) {
  const int64_t ld = nb * plane;
  parallel_for(nb * c, grain(plane), [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t b = q / c, ch = q % c;
      const float* src = tmp + ch * ld + b * plane;
      float* dst = y + q * plane;
      const float add = bias ? bias[ch] : 0.0f;
      for (int64_t p = 0; p < plane; ++p) dst[p] = src[p] + add;
    }
  });
}

void add_bias(const float* bias, int64_t c, int64_t plane, float* y) {
  for (int64_t ch = 0; ch < c; ++ch) {
    float* row = y + ch * plane;
    for (int64_t p = 0; p < plane; ++p) row[p] += bias[ch];
  }
}

// Runs chunk(first_image, images) over the batch. Several chunks run in
// parallel on the CPU pool with single-threaded GEMMs (see the top note).
template <typename F>
void for_each_chunk(const Conv2dShape& s, const Geometry& g, F&& chunk) {
  const int64_t chunks = g.chunks(s.n);
  auto run = [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t i0 = c * g.chunk;
      chunk(i0, std::min(g.chunk, s.n - i0));
    }
  };
  if (chunks < 2 || num_threads() < 2) {
    run(0, chunks);
    return;
  }
  SerialBlasScope serial;
  parallel_for(chunks, 1, run);
}

// Sum of a row in double. Eight accumulators break the add dependency chain
// (the compiler may not reassociate float sums by itself).
double row_sum(const float* p, int64_t len) {
  double acc[8] = {};
  int64_t i = 0;
  for (; i + 8 <= len; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += p[i + j];
  double total = 0.0;
  for (; i < len; ++i) total += p[i];
  for (double a : acc) total += a;
  return total;
}

std::string describe(const Conv2dShape& s) {
  auto v = [](int64_t a) { return std::to_string(a); };
  return "(n=" + v(s.n) + ", c_in=" + v(s.c_in) + ", h=" + v(s.h) + ", w=" + v(s.w) +
         ", c_out=" + v(s.c_out) + ", kernel=" + v(s.kh) + "x" + v(s.kw) +
         ", stride=" + v(s.stride_h) + "x" + v(s.stride_w) + ", pad=" + v(s.pad_h) + "x" +
         v(s.pad_w) + ", dilation=" + v(s.dil_h) + "x" + v(s.dil_w) + ", groups=" + v(s.groups) +
         ")";
}

}  // namespace

void check_conv2d_shape(const char* kernel, const Conv2dShape& s) {
  auto fail = [&](const std::string& why) {
    throw std::invalid_argument(std::string(kernel) + ": " + why + " " + describe(s));
  };
  if (s.n < 0) fail("batch size must be >= 0");
  if (s.c_in < 1 || s.c_out < 1 || s.h < 1 || s.w < 1) fail("channels and sizes must be >= 1");
  if (s.kh < 1 || s.kw < 1) fail("kernel size must be >= 1");
  if (s.stride_h < 1 || s.stride_w < 1) fail("stride must be >= 1");
  if (s.pad_h < 0 || s.pad_w < 0) fail("padding must be >= 0");
  if (s.dil_h < 1 || s.dil_w < 1) fail("dilation must be >= 1");
  if (s.groups < 1 || s.c_in % s.groups != 0 || s.c_out % s.groups != 0)
    fail("groups must be >= 1 and divide c_in and c_out");
  if (s.h + 2 * s.pad_h < s.dil_h * (s.kh - 1) + 1 || s.w + 2 * s.pad_w < s.dil_w * (s.kw - 1) + 1)
    fail("dilated kernel is larger than the padded input");
}

void conv2d_forward(const Conv2dShape& s, const float* x, const float* weight, const float* bias,
                    float* y) {
  check_conv2d_shape("conv2d_forward", s);
  const Geometry g = geometry(s);
  for_each_chunk(s, g, [&](int64_t i0, int64_t nb) {
    const float* xi = x + i0 * s.c_in * g.hw;
    float* yi = y + i0 * s.c_out * g.ohw;
    const int64_t ld = nb * g.ohw;
    const float* col = xi;
    if (!g.pointwise) {
      float* c = col_scratch(g.k_all * ld);
      im2col(s, g, xi, nb, c);
      col = c;
    }
    float* out = nb == 1 ? yi : tmp_scratch(s.c_out * ld);
    for (int64_t gr = 0; gr < s.groups; ++gr) {
      gemm(false, false, g.cout_g, ld, g.k_g, 1.0f, weight + gr * g.cout_g * g.k_g, g.k_g,
           col + gr * g.k_g * ld, ld, 0.0f, out + gr * g.cout_g * ld, ld);
    }
    if (nb == 1) {
      if (bias) add_bias(bias, s.c_out, g.ohw, yi);
    } else {
      unpack_channels(out, bias, nb, s.c_out, g.ohw, yi);
    }
  });
}

void conv2d_backward_input(const Conv2dShape& s, const float* dy, const float* weight, float* dx) {
  check_conv2d_shape("conv2d_backward_input", s);
  const Geometry g = geometry(s);
  for_each_chunk(s, g, [&](int64_t i0, int64_t nb) {
    const float* dyi = dy + i0 * s.c_out * g.ohw;
    float* dxi = dx + i0 * s.c_in * g.hw;
    const int64_t ld = nb * g.ohw;
    const float* d = dyi;
    if (nb > 1) {
      float* t = tmp_scratch(s.c_out * ld);
      pack_channels(dyi, nb, s.c_out, g.ohw, t);
      d = t;
    }
    // Pointwise: the column gradient is dx itself.
    float* col = g.pointwise ? dxi : col_scratch(g.k_all * ld);
    for (int64_t gr = 0; gr < s.groups; ++gr) {
      gemm(true, false, g.k_g, ld, g.cout_g, 1.0f, weight + gr * g.cout_g * g.k_g, g.k_g,
           d + gr * g.cout_g * ld, ld, 0.0f, col + gr * g.k_g * ld, ld);
    }
    if (!g.pointwise) col2im(s, g, col, nb, dxi);
  });
}

void conv2d_backward_weight(const Conv2dShape& s, const float* dy, const float* x, float* dweight,
                            float* dbias) {
  check_conv2d_shape("conv2d_backward_weight", s);
  const Geometry g = geometry(s);
  const int64_t w_size = s.c_out * g.k_g;
  // dweight sums over all images. Chunks are dealt to `parts` contiguous
  // groups; part 0 accumulates into dweight, the others into partial
  // buffers added at the end, in part order. (So the float summation order
  // depends on the thread count, as it does in other CPU frameworks.)
  const int64_t chunks = g.chunks(s.n);
  const int64_t parts = chunks < 2 ? 1 : std::min<int64_t>(num_threads(), chunks);
  float* partials = parts > 1 ? partial_scratch((parts - 1) * w_size) : nullptr;
  auto run_part = [&](int64_t part) {
    float* dst = part == 0 ? dweight : partials + (part - 1) * w_size;
    const int64_t c0 = part * chunks / parts, c1 = (part + 1) * chunks / parts;  // c0 < c1
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t i0 = c * g.chunk, nb = std::min(g.chunk, s.n - i0);
      const float* dyi = dy + i0 * s.c_out * g.ohw;
      const float* xi = x + i0 * s.c_in * g.hw;
      const int64_t ld = nb * g.ohw;
      const float* col = xi;
      if (!g.pointwise) {
        float* cbuf = col_scratch(g.k_all * ld);
        im2col(s, g, xi, nb, cbuf);
        col = cbuf;
      }
      const float* d = dyi;
      if (nb > 1) {
        float* t = tmp_scratch(s.c_out * ld);
        pack_channels(dyi, nb, s.c_out, g.ohw, t);
        d = t;
      }
      // The part's first chunk overwrites its sum, later ones accumulate.
      const float beta = c == c0 ? 0.0f : 1.0f;
      for (int64_t gr = 0; gr < s.groups; ++gr) {
        gemm(false, true, g.cout_g, g.k_g, ld, 1.0f, d + gr * g.cout_g * ld, ld,
             col + gr * g.k_g * ld, ld, beta, dst + gr * g.cout_g * g.k_g, g.k_g);
      }
    }
  };
  if (chunks == 0) {
    std::fill(dweight, dweight + w_size, 0.0f);  // empty batch: the sum is zero
  } else if (parts == 1) {
    run_part(0);
  } else {
    SerialBlasScope serial;
    parallel_for(parts, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) run_part(p);
    });
    for (int64_t p = 1; p < parts; ++p) {
      const float* src = partials + (p - 1) * w_size;
      for (int64_t i = 0; i < w_size; ++i) dweight[i] += src[i];
    }
  }
  if (dbias) {
    parallel_for(s.c_out, grain(s.n * g.ohw), [&](int64_t c0, int64_t c1) {
      for (int64_t co = c0; co < c1; ++co) {
        double acc = 0.0;
        for (int64_t b = 0; b < s.n; ++b) acc += row_sum(dy + (b * s.c_out + co) * g.ohw, g.ohw);
        dbias[co] = static_cast<float>(acc);
      }
    });
  }
}

}  // namespace chorus::cpu
