// CUDA gemm, convolutions, pooling and batch norm against the CPU kernel set
// (the independent reference), on random inputs, in float32 and bfloat16, for
// contiguous (NCHW) and channels-last (NHWC) tensors.
//
// Inputs are drawn in float and rounded to the tested dtype first, so the CPU
// computes in float32 on exactly the values the GPU sees; what differs is only
// the GPU's arithmetic. Errors are measured as max|gpu - cpu| / max|cpu|, the
// error relative to the output's scale. Tolerances:
//  - float32 GEMM, pooling: 1e-5 (float rounding, different summation order);
//  - float32 convolution, batch norm: 1e-4 (cuDNN may pick FFT or Winograd
//    algorithms, whose transforms lose a few more bits than direct summation,
//    and batch norm's backward subtracts means of dy, which cancels);
//  - bfloat16 and float16 outputs: 2e-2 (the output is rounded to 8 bits of
//    mantissa, 2^-9 relative, plus cuDNN's internal bfloat16 steps);
//  - TF32 (10-bit mantissa inputs): 5e-3.
// TF32 is turned off for the float32 comparisons (it is on by default for
// convolutions, see blas.h) except in the test of the TF32 path itself.
#ifdef CHORUS_WITH_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "testing/random.h"
#include "chorus/core/backend.h"
#include "chorus/core/tensor.h"
#include "chorus/cpu/kernels.h"
#include "chorus/cuda/blas/blas.h"
#include "chorus/cuda/kernels/kernels.h"
#ifdef CHORUS_WITH_CUDNN
#include "chorus/cuda/conv/conv_plan.h"
#endif

namespace chorus {
namespace {

const Device kGpu = cuda_device(0);
const Device kHost = cpu_device(0);

using chorus::testing::random_vector;

// The values as `dtype` stores them.
std::vector<float> rounded(std::vector<float> v, DType dtype) {
  for (float& e : v) {
    if (dtype == kBFloat16) e = static_cast<float>(BFloat16(e));
    if (dtype == kFloat16) e = static_cast<float>(Float16(e));
  }
  return v;
}

// A contiguous host tensor of `dtype` holding row-major `values`.
Tensor host_tensor(const Shape& sizes, const std::vector<float>& values, DType dtype) {
  Tensor t = detail::empty_tensor(sizes, dtype, kHost);
  EXPECT_EQ(static_cast<size_t>(t.numel()), values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    switch (dtype) {
      case kFloat32:
        t.data<float>()[i] = values[i];
        break;
      case kBFloat16:
        t.data<BFloat16>()[i] = BFloat16(values[i]);
        break;
      case kFloat16:
        t.data<Float16>()[i] = Float16(values[i]);
        break;
      case kInt64:
        t.data<int64_t>()[i] = static_cast<int64_t>(values[i]);
        break;
      default:
        ADD_FAILURE() << "host_tensor: unsupported dtype " << dtype_name(dtype);
        return t;
    }
  }
  return t;
}

// The values of a contiguous host tensor, as floats.
std::vector<float> host_values(const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < v.size(); ++i) {
    switch (t.dtype()) {
      case kFloat32:
        v[i] = t.data<float>()[i];
        break;
      case kBFloat16:
        v[i] = static_cast<float>(t.data<BFloat16>()[i]);
        break;
      case kFloat16:
        v[i] = static_cast<float>(t.data<Float16>()[i]);
        break;
      case kInt64:
        v[i] = static_cast<float>(t.data<int64_t>()[i]);
        break;
      default:
        ADD_FAILURE() << "host_values: unsupported dtype " << dtype_name(t.dtype());
        return v;
    }
  }
  return v;
}

// The NHWC order of row-major NCHW `values`.
std::vector<float> to_nhwc(const Shape& s, const std::vector<float>& values) {
  const int64_t N = s[0], C = s[1], H = s[2], W = s[3];
  std::vector<float> out(values.size());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t w = 0; w < W; ++w)
          out[((n * H + h) * W + w) * C + c] = values[((n * C + c) * H + h) * W + w];
  return out;
}

// A GPU tensor with row-major `values`; a 4-d one is stored channels-last when
// asked (a [N,C,H,W] view of an [N,H,W,C] allocation).
Tensor gpu_tensor(const Shape& sizes, const std::vector<float>& values, DType dtype,
                  bool channels_last = false) {
  if (channels_last) {
    const int64_t N = sizes[0], C = sizes[1], H = sizes[2], W = sizes[3];
    Tensor t = gpu_tensor({N, H, W, C}, to_nhwc(sizes, values), dtype);
    return detail::make_view(t, sizes, {H * W * C, 1, W * C, C}, 0);
  }
  Tensor h = host_tensor(sizes, values, dtype);
  Tensor d = detail::empty_tensor(sizes, dtype, kGpu);
  backend(kGpu).copy(d.raw_data(), kGpu, h.raw_data(), kHost, h.nbytes());
  return d;
}

// A GPU tensor filled with large values, for outputs that must be overwritten.
Tensor gpu_garbage(const Shape& sizes, DType dtype, bool channels_last = false) {
  return gpu_tensor(sizes, random_vector(numel_of(sizes), 999, 100.0f, 1000.0f), dtype,
                    channels_last);
}

// The row-major values of a GPU tensor with any non-negative strides.
std::vector<float> gpu_values(const Tensor& t) {
  if (t.numel() == 0) return {};
  int64_t span = 1;
  for (int64_t d = 0; d < t.dim(); ++d) span += (t.size(d) - 1) * t.stride(d);
  Tensor h = detail::empty_tensor({span}, t.dtype(), kHost);
  backend(kGpu).copy(h.raw_data(), kHost, t.raw_data(), kGpu,
                     static_cast<size_t>(span) * t.element_size());
  const std::vector<float> flat = host_values(h);
  std::vector<float> out(static_cast<size_t>(t.numel()));
  std::vector<int64_t> idx(static_cast<size_t>(t.dim()), 0);
  for (size_t i = 0; i < out.size(); ++i) {
    int64_t off = 0;
    for (int64_t d = 0; d < t.dim(); ++d) off += idx[d] * t.stride(d);
    out[i] = flat[static_cast<size_t>(off)];
    for (int64_t d = t.dim() - 1; d >= 0; --d) {
      if (++idx[d] < t.size(d)) break;
      idx[d] = 0;
    }
  }
  return out;
}

Tensor cpu_f32(const Shape& sizes, const std::vector<float>& values) {
  return host_tensor(sizes, values, kFloat32);
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want, double tol,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double err = 0.0, scale = 0.0;
  size_t worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double e = std::abs(static_cast<double>(got[i]) - want[i]);
    if (!(e <= err)) {  // also catches NaN
      err = std::isnan(e) ? INFINITY : e;
      worst = i;
    }
    scale = std::max(scale, std::abs(static_cast<double>(want[i])));
  }
  const double rel = err / std::max(scale, 1e-30);
  EXPECT_LE(rel, tol) << what << ": max |gpu - cpu| / max |cpu| = " << rel << " at index " << worst
                      << " (gpu " << got[worst] << ", cpu " << want[worst] << ")";
}

double tolerance(DType dtype, double float32_tol) { return dtype == kFloat32 ? float32_tol : 2e-2; }

// Turns TF32 off for the scope of a test, and restores the switches.
class NoTf32 {
 public:
  NoTf32() : matmul_(cuda::allow_tf32_matmul()), conv_(cuda::allow_tf32_conv()) {
    cuda::set_allow_tf32(false);
  }
  ~NoTf32() {
    cuda::set_allow_tf32_matmul(matmul_);
    cuda::set_allow_tf32_conv(conv_);
  }

 private:
  bool matmul_, conv_;
};

// ---- gemm ------------------------------------------------------------------------------------

void check_gemm(DType dtype, bool trans_a, bool trans_b, double alpha, double beta, double tol) {
  // Odd sizes, so that rows are not 16-byte multiples (cuBLASLt's alignment path).
  const int64_t batch = 3, m = 37, n = 29, k = 53;
  const Shape as = trans_a ? Shape{batch, k, m} : Shape{batch, m, k};
  const Shape bs = trans_b ? Shape{batch, n, k} : Shape{batch, k, n};
  const Shape os{batch, m, n};
  const auto av = rounded(random_vector(numel_of(as), 1), dtype);
  const auto bv = rounded(random_vector(numel_of(bs), 2), dtype);
  const auto ov = rounded(random_vector(numel_of(os), 3), dtype);

  Tensor ga = gpu_tensor(as, av, dtype), gb = gpu_tensor(bs, bv, dtype);
  Tensor go = gpu_tensor(os, beta == 0.0 ? std::vector<float>(ov.size(), NAN) : ov, dtype);
  cuda::gemm(ga, gb, go, trans_a, trans_b, alpha, beta);

  Tensor ca = cpu_f32(as, av), cb = cpu_f32(bs, bv), co = cpu_f32(os, ov);
  cpu::gemm(ca, cb, co, trans_a, trans_b, alpha, beta);
  expect_close(gpu_values(go), host_values(co), tol,
               std::string("gemm ") + dtype_name(dtype) + " trans_a=" + std::to_string(trans_a) +
                   " trans_b=" + std::to_string(trans_b) + " beta=" + std::to_string(beta));
}

TEST(CudaGemm, Float32MatchesCpu_CUDA) {
  if (chorus::cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  NoTf32 no_tf32;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) check_gemm(kFloat32, ta, tb, 0.75, 0.5, 1e-5);
}

TEST(CudaGemm, BetaZeroDoesNotReadOutput_CUDA) {
  if (chorus::cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  NoTf32 no_tf32;
  check_gemm(kFloat32, false, true, 1.0, 0.0, 1e-5);  // out starts as NaN
}

TEST(CudaGemm, HalfTypesMatchCpu_CUDA) {
  if (chorus::cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  for (DType dtype : {kBFloat16, kFloat16})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) check_gemm(dtype, ta, tb, 1.25, 0.5, 2e-2);
}

TEST(CudaGemm, Tf32MatchesCpuLoosely_CUDA) {
  if (chorus::cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  NoTf32 restore;
  cuda::set_allow_tf32(true);
  check_gemm(kFloat32, true, false, 1.0, 0.0, 5e-3);
}

// ---- convolution --------------------------------------------------------------------------------

struct ConvCase {
  const char* name;
  Conv2dGeometry g;
  bool weight_in_other_layout;  // weight stored unlike the activations (converted inside)
};

std::vector<ConvCase> conv_cases() {
  return {
      {"3x3 same",
       {.n = 2, .c_in = 8, .h = 9, .w = 9, .c_out = 16, .kh = 3, .kw = 3, .pad_h = 1, .pad_w = 1},
       false},
      {"3x3 stride 2 groups 2",
       {.n = 2,
        .c_in = 8,
        .h = 10,
        .w = 7,
        .c_out = 12,
        .kh = 3,
        .kw = 3,
        .stride_h = 2,
        .stride_w = 2,
        .pad_h = 1,
        .pad_w = 1,
        .groups = 2},
       true},
      {"1x1 stride 2",
       {.n = 3,
        .c_in = 16,
        .h = 8,
        .w = 8,
        .c_out = 32,
        .kh = 1,
        .kw = 1,
        .stride_h = 2,
        .stride_w = 2},
       false},
      {"3x3 dilation 2 groups 4",
       {.n = 2,
        .c_in = 8,
        .h = 11,
        .w = 11,
        .c_out = 8,
        .kh = 3,
        .kw = 3,
        .pad_h = 2,
        .pad_w = 2,
        .dil_h = 2,
        .dil_w = 2,
        .groups = 4},
       false},
  };
}

void check_conv(const ConvCase& cc, DType dtype, bool channels_last, double float32_tol) {
  const Conv2dGeometry& g = cc.g;
  const Shape xs{g.n, g.c_in, g.h, g.w}, ws{g.c_out, g.c_in / g.groups, g.kh, g.kw},
      ys{g.n, g.c_out, g.out_h(), g.out_w()}, bs{g.c_out};
  const bool weight_cl = channels_last != cc.weight_in_other_layout;
  const auto xv = rounded(random_vector(numel_of(xs), 11), dtype);
  const auto wv = rounded(random_vector(numel_of(ws), 12), dtype);
  const auto bv = rounded(random_vector(numel_of(bs), 13), dtype);
  const auto dyv = rounded(random_vector(numel_of(ys), 14), dtype);
  const double tol = tolerance(dtype, float32_tol);
  const std::string what = std::string(cc.name) + " " + dtype_name(dtype) +
                           (channels_last ? " NHWC" : " NCHW") +
                           (weight_cl ? " (weight NHWC)" : "");

  Tensor gx = gpu_tensor(xs, xv, dtype, channels_last), gw = gpu_tensor(ws, wv, dtype, weight_cl);
  Tensor gb = gpu_tensor(bs, bv, dtype), gdy = gpu_tensor(ys, dyv, dtype, channels_last);
  Tensor cx = cpu_f32(xs, xv), cw = cpu_f32(ws, wv), cb = cpu_f32(bs, bv), cdy = cpu_f32(ys, dyv);

  Tensor gy = gpu_garbage(ys, dtype, channels_last),
         cy = cpu_f32(ys, std::vector<float>(dyv.size()));
  cuda::conv2d_forward(g, gx, gw, gb, gy);
  cpu::conv2d_forward(g, cx, cw, cb, cy);
  expect_close(gpu_values(gy), host_values(cy), tol, "conv2d_forward " + what);

  Tensor gdx = gpu_garbage(xs, dtype, channels_last),
         cdx = cpu_f32(xs, std::vector<float>(xv.size()));
  cuda::conv2d_backward_input(g, gdy, gw, gdx);
  cpu::conv2d_backward_input(g, cdy, cw, cdx);
  expect_close(gpu_values(gdx), host_values(cdx), tol, "conv2d_backward_input " + what);

  Tensor gdw = gpu_garbage(ws, dtype, weight_cl), gdb = gpu_garbage(bs, dtype);
  Tensor cdw = cpu_f32(ws, std::vector<float>(wv.size())),
         cdb = cpu_f32(bs, std::vector<float>(bv.size()));
  cuda::conv2d_backward_weight(g, gdy, gx, gdw, gdb);
  cpu::conv2d_backward_weight(g, cdy, cx, cdw, cdb);
  expect_close(gpu_values(gdw), host_values(cdw), tol, "conv2d_backward_weight " + what);
  expect_close(gpu_values(gdb), host_values(cdb), tol, "conv2d_backward_weight (bias) " + what);
}

TEST(CudaConv, Float32MatchesCpu_CUDA) {
  if (chorus::cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  NoTf32 no_tf32;
  for (const ConvCase& cc : conv_cases())
    for (bool cl : {false, true}) check_conv(cc, kFloat32, cl, 1e-4);
}

TEST(CudaConv, BFloat16MatchesCpu_CUDA) {
  if (chorus::cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  for (const ConvCase& cc : conv_cases())
    for (bool cl : {false, true}) check_conv(cc, kBFloat16, cl, 1e-4);
}

#ifdef CHORUS_WITH_CUDNN
// Note [Heuristic plans]: cuDNN's first-ranked plans, untimed, compute the
// same convolutions (plans of both kinds are cached apart).
TEST(CudaConv, HeuristicPlansMatchCpu_CUDA) {
  if (chorus::cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  NoTf32 no_tf32;
  struct Restore {
    bool prev = cuda::heuristic_plans();
    ~Restore() { cuda::set_heuristic_plans(prev); }
  } restore;
  cuda::set_heuristic_plans(true);
  for (const ConvCase& cc : conv_cases()) {
    for (bool cl : {false, true}) {
      check_conv(cc, kFloat32, cl, 1e-4);
      check_conv(cc, kBFloat16, cl, 1e-4);
    }
  }
}
#endif

TEST(CudaConv, Tf32MatchesCpuLoosely_CUDA) {
  if (chorus::cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  NoTf32 restore;
  cuda::set_allow_tf32_conv(true);
  for (bool cl : {false, true}) check_conv(conv_cases()[0], kFloat32, cl, 5e-3);
}

// ---- pooling -----------------------------------------------------------------------------------

// Values distinct within each [H, W] plane (so max pooling has no ties) and
// exact in bfloat16 (small integers over 32).
std::vector<float> distinct_plane_values(const Shape& s, uint32_t seed) {
  const int64_t plane = s[2] * s[3], planes = s[0] * s[1];
  std::mt19937 gen(seed);
  std::vector<float> v;
  std::vector<int64_t> ints(static_cast<size_t>(plane));
  for (int64_t p = 0; p < planes; ++p) {
    std::iota(ints.begin(), ints.end(), -plane / 2);
    std::shuffle(ints.begin(), ints.end(), gen);
    for (int64_t i : ints) v.push_back(static_cast<float>(i) / 32.0f);
  }
  return v;
}

const std::vector<Pool2dGeometry> kPoolGeometries = {
    {.n = 2,
     .c = 5,
     .h = 9,
     .w = 7,
     .kh = 3,
     .kw = 3,
     .stride_h = 2,
     .stride_w = 2,
     .pad_h = 1,
     .pad_w = 1},
    {.n = 2, .c = 3, .h = 8, .w = 8, .kh = 2, .kw = 2, .stride_h = 2, .stride_w = 2},
};

void check_max_pool(const Pool2dGeometry& g, DType dtype, bool cl) {
  const Shape xs{g.n, g.c, g.h, g.w}, ys{g.n, g.c, g.out_h(), g.out_w()};
  const auto xv = distinct_plane_values(xs, 21);
  const auto dyv = rounded(random_vector(numel_of(ys), 22), dtype);
  const std::string what = std::string(dtype_name(dtype)) + (cl ? " NHWC" : " NCHW") + " k" +
                           std::to_string(g.kh) + " s" + std::to_string(g.stride_h) + " p" +
                           std::to_string(g.pad_h);

  Tensor gx = gpu_tensor(xs, xv, dtype, cl), gy = gpu_garbage(ys, dtype, cl);
  Tensor gi = gpu_tensor(ys, std::vector<float>(dyv.size(), -1.0f), kInt64, cl);
  cuda::max_pool2d_forward(g, gx, gy, gi);
  Tensor cx = cpu_f32(xs, xv), cy = cpu_f32(ys, std::vector<float>(dyv.size()));
  Tensor ci = host_tensor(ys, std::vector<float>(dyv.size()), kInt64);
  cpu::max_pool2d_forward(g, cx, cy, ci);
  expect_close(gpu_values(gy), host_values(cy), 0.0, "max_pool2d_forward " + what);
  EXPECT_EQ(gpu_values(gi), host_values(ci)) << "max_pool2d_forward indices " << what;

  Tensor gdy = gpu_tensor(ys, dyv, dtype, cl), gdx = gpu_garbage(xs, dtype, cl);
  cuda::max_pool2d_backward(g, gdy, gi, gdx);
  Tensor cdy = cpu_f32(ys, dyv), cdx = cpu_f32(xs, std::vector<float>(xv.size()));
  cpu::max_pool2d_backward(g, cdy, ci, cdx);
  expect_close(gpu_values(gdx), host_values(cdx), tolerance(dtype, 1e-5),
               "max_pool2d_backward " + what);
}

void check_avg_pool(const Pool2dGeometry& g, DType dtype, bool cl) {
  const Shape xs{g.n, g.c, g.h, g.w}, ys{g.n, g.c, g.out_h(), g.out_w()};
  const auto xv = rounded(random_vector(numel_of(xs), 31), dtype);
  const auto dyv = rounded(random_vector(numel_of(ys), 32), dtype);
  const double tol = tolerance(dtype, 1e-5);
  const std::string what = std::string(dtype_name(dtype)) + (cl ? " NHWC" : " NCHW") + " k" +
                           std::to_string(g.kh) + " s" + std::to_string(g.stride_h) + " p" +
                           std::to_string(g.pad_h);

  Tensor gx = gpu_tensor(xs, xv, dtype, cl), gy = gpu_garbage(ys, dtype, cl);
  cuda::avg_pool2d_forward(g, gx, gy);
  Tensor cx = cpu_f32(xs, xv), cy = cpu_f32(ys, std::vector<float>(dyv.size()));
  cpu::avg_pool2d_forward(g, cx, cy);
  expect_close(gpu_values(gy), host_values(cy), tol, "avg_pool2d_forward " + what);

  Tensor gdy = gpu_tensor(ys, dyv, dtype, cl), gdx = gpu_garbage(xs, dtype, cl);
  cuda::avg_pool2d_backward(g, gdy, gdx);
  Tensor cdy = cpu_f32(ys, dyv), cdx = cpu_f32(xs, std::vector<float>(xv.size()));
  cpu::avg_pool2d_backward(g, cdy, cdx);
  expect_close(gpu_values(gdx), host_values(cdx), tol, "avg_pool2d_backward " + what);
}

void check_adaptive_avg_pool(const Shape& xs, int64_t oh, int64_t ow, DType dtype, bool cl) {
  const Shape ys{xs[0], xs[1], oh, ow};
  const auto xv = rounded(random_vector(numel_of(xs), 41), dtype);
  const auto dyv = rounded(random_vector(numel_of(ys), 42), dtype);
  const double tol = tolerance(dtype, 1e-5);
  const std::string what = std::string(dtype_name(dtype)) + (cl ? " NHWC " : " NCHW ") +
                           shape_str(xs) + " -> " + shape_str(ys);

  Tensor gx = gpu_tensor(xs, xv, dtype, cl), gy = gpu_garbage(ys, dtype, cl);
  cuda::adaptive_avg_pool2d_forward(gx, gy);
  Tensor cx = cpu_f32(xs, xv), cy = cpu_f32(ys, std::vector<float>(dyv.size()));
  cpu::adaptive_avg_pool2d_forward(cx, cy);
  expect_close(gpu_values(gy), host_values(cy), tol, "adaptive_avg_pool2d_forward " + what);

  Tensor gdy = gpu_tensor(ys, dyv, dtype, cl), gdx = gpu_garbage(xs, dtype, cl);
  cuda::adaptive_avg_pool2d_backward(gdy, gdx);
  Tensor cdy = cpu_f32(ys, dyv), cdx = cpu_f32(xs, std::vector<float>(xv.size()));
  cpu::adaptive_avg_pool2d_backward(cdy, cdx);
  expect_close(gpu_values(gdx), host_values(cdx), tol, "adaptive_avg_pool2d_backward " + what);
}

TEST(CudaPool, MaxPoolMatchesCpu_CUDA) {
  if (chorus::cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  for (const Pool2dGeometry& g : kPoolGeometries)
    for (DType dtype : {kFloat32, kBFloat16})
      for (bool cl : {false, true}) check_max_pool(g, dtype, cl);
}

TEST(CudaPool, AvgPoolMatchesCpu_CUDA) {
  if (chorus::cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  for (const Pool2dGeometry& g : kPoolGeometries)
    for (DType dtype : {kFloat32, kBFloat16})
      for (bool cl : {false, true}) check_avg_pool(g, dtype, cl);
}

TEST(CudaPool, AdaptiveAvgPoolMatchesCpu_CUDA) {
  if (chorus::cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  for (DType dtype : {kFloat32, kBFloat16})
    for (bool cl : {false, true}) {
      check_adaptive_avg_pool({2, 5, 9, 7}, 4, 3, dtype, cl);   // overlapping windows
      check_adaptive_avg_pool({3, 16, 8, 8}, 1, 1, dtype, cl);  // the WRN head
      check_adaptive_avg_pool({2, 24, 7, 5}, 1, 1, dtype, cl);  // global, plane of 35
      check_adaptive_avg_pool({3, 20, 4, 4}, 1, 1, dtype, cl);  // global, 20 channels: packs of 4, not 8
    }
}

// ---- batch norm
// ----------------------------------------------------------------------------------

void check_batch_norm(const Shape& xs, DType dtype, bool cl, bool affine) {
  const int64_t c = xs[1];
  const Shape ps{c};
  const double momentum = 0.1, eps = 1e-3;  // eps != 1e-5: catches an eps the backward must not use
  const auto xv = rounded(random_vector(numel_of(xs), 51, -2.0f, 3.0f), dtype);
  const auto dyv = rounded(random_vector(numel_of(xs), 52), dtype);
  const auto gammav = random_vector(c, 53, 0.5f, 1.5f), betav = random_vector(c, 54);
  const auto rmv = random_vector(c, 55), rvv = random_vector(c, 56, 0.5f, 1.5f);
  const double tol = tolerance(dtype, 1e-4);
  const std::string what = std::string(dtype_name(dtype)) + (cl ? " NHWC " : " ") + shape_str(xs) +
                           (affine ? "" : " (no affine, no running stats)");

  // Forward, training.
  Tensor gx = gpu_tensor(xs, xv, dtype, cl), gy = gpu_garbage(xs, dtype, cl);
  Tensor ggamma, gbeta, grm, grv, cgamma, cbeta, crm, crv;
  if (affine) {
    ggamma = gpu_tensor(ps, gammav, kFloat32), gbeta = gpu_tensor(ps, betav, kFloat32);
    grm = gpu_tensor(ps, rmv, kFloat32), grv = gpu_tensor(ps, rvv, kFloat32);
    cgamma = cpu_f32(ps, gammav), cbeta = cpu_f32(ps, betav);
    crm = cpu_f32(ps, rmv), crv = cpu_f32(ps, rvv);
  }
  Tensor gsm = gpu_garbage(ps, kFloat32), gsi = gpu_garbage(ps, kFloat32);
  cuda::batch_norm_forward(gx, ggamma, gbeta, grm, grv, true, momentum, eps, gy, gsm, gsi);
  Tensor cx = cpu_f32(xs, xv), cy = cpu_f32(xs, std::vector<float>(xv.size()));
  Tensor csm = cpu_f32(ps, std::vector<float>(c)), csi = cpu_f32(ps, std::vector<float>(c));
  cpu::batch_norm_forward(cx, cgamma, cbeta, crm, crv, true, momentum, eps, cy, csm, csi);
  expect_close(gpu_values(gy), host_values(cy), tol, "batch_norm_forward y " + what);
  expect_close(gpu_values(gsm), host_values(csm), tol, "batch_norm_forward save_mean " + what);
  expect_close(gpu_values(gsi), host_values(csi), tol, "batch_norm_forward save_invstd " + what);
  if (affine) {
    expect_close(gpu_values(grm), host_values(crm), tol, "batch_norm_forward running_mean " + what);
    expect_close(gpu_values(grv), host_values(crv), tol, "batch_norm_forward running_var " + what);
  }

  // Backward.
  Tensor gdy = gpu_tensor(xs, dyv, dtype, cl), gdx = gpu_garbage(xs, dtype, cl);
  Tensor gdgamma, gdbeta, cdgamma, cdbeta;
  if (affine) {
    gdgamma = gpu_garbage(ps, kFloat32), gdbeta = gpu_garbage(ps, kFloat32);
    cdgamma = cpu_f32(ps, std::vector<float>(c)), cdbeta = cpu_f32(ps, std::vector<float>(c));
  }
  cuda::batch_norm_backward(gdy, gx, ggamma, gsm, gsi, gdx, gdgamma, gdbeta);
  Tensor cdy = cpu_f32(xs, dyv), cdx = cpu_f32(xs, std::vector<float>(xv.size()));
  cpu::batch_norm_backward(cdy, cx, cgamma, csm, csi, cdx, cdgamma, cdbeta);
  expect_close(gpu_values(gdx), host_values(cdx), tol, "batch_norm_backward dx " + what);
  if (affine) {
    expect_close(gpu_values(gdgamma), host_values(cdgamma), tol,
                 "batch_norm_backward dgamma " + what);
    expect_close(gpu_values(gdbeta), host_values(cdbeta), tol, "batch_norm_backward dbeta " + what);
  }

  // Forward, evaluation, with the running statistics just updated.
  if (affine) {
    Tensor gy2 = gpu_garbage(xs, dtype, cl), cy2 = cpu_f32(xs, std::vector<float>(xv.size()));
    cuda::batch_norm_forward(gx, ggamma, gbeta, grm, grv, false, momentum, eps, gy2, Tensor(),
                             Tensor());
    cpu::batch_norm_forward(cx, cgamma, cbeta, crm, crv, false, momentum, eps, cy2, Tensor(),
                            Tensor());
    expect_close(gpu_values(gy2), host_values(cy2), tol, "batch_norm_forward (eval) y " + what);
  }
}

// The fused batch norm + ReLU (own kernels for channels-last, cuDNN plus a
// ReLU pass for NCHW) against the CPU's composition of the two.
// Without affine (gamma and beta undefined: 1 and 0) the channels-last
// backward recomputes the ReLU's mask from x with the defaults. With an
// addend, dx also adds it (Note [Gradient addends]: in the elementwise pass on
// channels-last tensors, a separate add on NCHW and on the CPU).
void check_batch_norm_relu(const Shape& xs, DType dtype, bool cl, bool affine = true, bool addend = false) {
  const int64_t c = xs[1];
  const Shape ps{c};
  const auto xv = rounded(random_vector(numel_of(xs), 61, -2.0f, 3.0f), dtype);
  const auto dyv = rounded(random_vector(numel_of(xs), 62), dtype);
  const auto gammav = affine ? random_vector(c, 63, 0.5f, 1.5f) : std::vector<float>(c, 1.0f);
  const auto betav = affine ? random_vector(c, 64) : std::vector<float>(c, 0.0f);
  const auto rmv = random_vector(c, 65), rvv = random_vector(c, 66, 0.5f, 1.5f);
  const double tol = tolerance(dtype, 1e-4);
  const std::string what = std::string(dtype_name(dtype)) + (cl ? " NHWC " : " ") + shape_str(xs);
  Tensor gx = gpu_tensor(xs, xv, dtype, cl), gy = gpu_garbage(xs, dtype, cl);
  Tensor ggamma = affine ? gpu_tensor(ps, gammav, kFloat32) : Tensor();
  Tensor gbeta = affine ? gpu_tensor(ps, betav, kFloat32) : Tensor();
  Tensor grm = gpu_tensor(ps, rmv, kFloat32), grv = gpu_tensor(ps, rvv, kFloat32);
  Tensor gsm = gpu_garbage(ps, kFloat32), gsi = gpu_garbage(ps, kFloat32);
  // The module's batch counter, incremented by the statistics' finalize
  // kernel (channels-last) or an add (NCHW), from 41.
  Tensor gcount = full({}, 41.0, {kInt64, cuda_device(0)}), ccount = full({}, 41.0, {kInt64});
  cuda::batch_norm_relu_forward(gx, ggamma, gbeta, grm, grv, 0.1, 1e-3, gy, gsm, gsi, gcount);
  Tensor cx = cpu_f32(xs, xv), cy = cpu_f32(xs, std::vector<float>(xv.size()));
  Tensor cgamma = cpu_f32(ps, gammav), cbeta = cpu_f32(ps, betav), crm = cpu_f32(ps, rmv), crv = cpu_f32(ps, rvv);
  Tensor csm = cpu_f32(ps, std::vector<float>(c)), csi = cpu_f32(ps, std::vector<float>(c));
  cpu::batch_norm_relu_forward(cx, cgamma, cbeta, crm, crv, 0.1, 1e-3, cy, csm, csi, ccount);
  EXPECT_EQ(gcount.to(cpu_device(0)).to_vector<int64_t>(), std::vector<int64_t>{42}) << "num_batches_tracked " << what;
  EXPECT_EQ(ccount.to_vector<int64_t>(), std::vector<int64_t>{42}) << "num_batches_tracked (CPU) " << what;
  expect_close(gpu_values(gy), host_values(cy), tol, "batch_norm_relu_forward y " + what);
  expect_close(gpu_values(grv), host_values(crv), tol, "batch_norm_relu_forward running_var " + what);
  // Backward from the GPU's own y (its ReLU mask), against the CPU's from its y.
  Tensor gdy = gpu_tensor(xs, dyv, dtype, cl), gdx = gpu_garbage(xs, dtype, cl);
  Tensor gdg = gpu_garbage(ps, kFloat32), gdb = gpu_garbage(ps, kFloat32);
  const auto addv = rounded(random_vector(numel_of(xs), 67, -3.0f, 3.0f), dtype);
  Tensor gadd = addend ? gpu_tensor(xs, addv, dtype, cl) : Tensor();
  cuda::batch_norm_relu_backward(gdy, gy, gx, ggamma, gbeta, gsm, gsi, gdx, gdg, gdb, gadd);
  Tensor cdy = cpu_f32(xs, dyv), cdx = cpu_f32(xs, std::vector<float>(xv.size()));
  Tensor cdg = cpu_f32(ps, std::vector<float>(c)), cdb = cpu_f32(ps, std::vector<float>(c));
  cpu::batch_norm_relu_backward(cdy, cy, cx, cgamma, cbeta, csm, csi, cdx, cdg, cdb,
                                addend ? cpu_f32(xs, addv) : Tensor());
  expect_close(gpu_values(gdx), host_values(cdx), tol,
               std::string("batch_norm_relu_backward dx ") + (addend ? "+ addend " : "") + what);
  expect_close(gpu_values(gdg), host_values(cdg), tol, "batch_norm_relu_backward dgamma " + what);
  expect_close(gpu_values(gdb), host_values(cdb), tol, "batch_norm_relu_backward dbeta " + what);
}

TEST(CudaBatchNorm, FusedReluMatchesCpu_CUDA) {
  if (chorus::cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  for (DType dtype : {kFloat32, kBFloat16}) {
    for (bool cl : {false, true}) check_batch_norm_relu({8, 16, 6, 5}, dtype, cl);
    check_batch_norm_relu({16, 640, 3, 3}, dtype, true);
    check_batch_norm_relu({4, 3, 7, 5}, dtype, true);  // odd C: scalar path
    check_batch_norm_relu({8, 32, 6, 5}, dtype, true, false);
    for (bool cl : {false, true}) check_batch_norm_relu({8, 64, 6, 5}, dtype, cl, true, /*addend=*/true);
    check_batch_norm_relu({4, 3, 7, 5}, dtype, true, true, /*addend=*/true);
  }
}

TEST(CudaBatchNorm, MatchesCpu_CUDA) {
  if (chorus::cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  for (DType dtype : {kFloat32, kBFloat16}) {
    for (bool cl : {false, true}) check_batch_norm({4, 6, 5, 3}, dtype, cl, true);
    // Channels-last runs Chorus's own kernels: 16-byte packs (C % 8 == 0), many
    // row blocks, and odd C (the scalar path).
    check_batch_norm({32, 64, 16, 12}, dtype, true, true);
    // Wide rows: 80 threads across (C 640 in packs of 8 or 4), and more
    // channels than one block's 256 threads cover (C 2560).
    check_batch_norm({8, 640, 4, 4}, dtype, true, true);
    check_batch_norm({3, 2560, 3, 3}, dtype, true, true);
    check_batch_norm({4, 3, 7, 5}, dtype, true, false);
    check_batch_norm({16, 5}, dtype, false, true);        // [N, C] as [N, C, 1, 1]
    check_batch_norm({4, 6, 5, 3}, dtype, false, false);  // gamma, beta, running stats undefined
  }
}

}  // namespace
}  // namespace chorus

#endif  // CHORUS_WITH_CUDA
