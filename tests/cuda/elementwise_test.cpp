// The CUDA kernel set (all but gemm, convolution, pooling and batch norm,
// which gemm_conv_test.cpp covers, and the optimizers, which
// optim_kernels_test.cpp covers) against the CPU kernel set, the independent
// reference, on random inputs.
//
// Every test builds "twins": a host tensor and a byte-identical copy on the
// GPU with the same geometry, so strided views (transposed, broadcast with
// stride 0, offset slices) are exercised on both sides alike. Tolerances, as
// |gpu - cpu| <= rtol * |cpu| + atol * max|cpu|:
//  - exact (0, 0): moves, conversions, comparisons, integer math, indexing,
//    uniform/randint/dropout (the same Philox words and float formulas);
//  - float32 math: rtol 2e-6 (CUDA's expf/tanhf/powf are within 2 ulp, glibc
//    within 1; fused multiply-adds on the GPU round once where the CPU rounds twice);
//  - float32 reductions: 1e-5 (float accumulation in another order; the CPU sums in double);
//  - bfloat16/float16 outputs: 1e-2 (one ulp of an 8-bit mantissa when the float
//    results straddle a rounding boundary);
//  - normal(): 1e-5 (log and cos of CUDA vs glibc).
#ifdef CHORUS_WITH_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/core/tensor.h"
#include "chorus/cpu/kernels.h"
#include "chorus/cuda/kernels/kernels.h"
#include "chorus/ops/factory.h"
#include "cuda/twins.h"

namespace chorus {
namespace {

using namespace cuda_twins;

const DType kAllDtypes[] = {kFloat32, kBFloat16, kFloat16, kInt64, kInt32, kUInt8, kBool};

// ---- unary, binary -----------------------------------------------------------------------------

TEST(CudaKernels, UnaryMatchesCpu_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  struct Case {
    UnaryOp op;
    const char* label;
    double scalar;
    bool positive;  // the op needs x > 0
  };
  const Case cases[] = {
      {UnaryOp::Neg, "neg", 0, false},         {UnaryOp::Exp, "exp", 0, false},
      {UnaryOp::Log, "log", 0, true},          {UnaryOp::Sqrt, "sqrt", 0, true},
      {UnaryOp::Rsqrt, "rsqrt", 0, true},      {UnaryOp::Tanh, "tanh", 0, false},
      {UnaryOp::Sigmoid, "sigmoid", 0, false}, {UnaryOp::Relu, "relu", 0, false},
      {UnaryOp::Abs, "abs", 0, false},         {UnaryOp::Square, "square", 0, false},
      {UnaryOp::Reciprocal, "reciprocal", 0, true}, {UnaryOp::Sign, "sign", 0, false},
      {UnaryOp::Pow, "pow", 2.5, true},        {UnaryOp::AddScalar, "add_scalar", 0.75, false},
      {UnaryOp::MulScalar, "mul_scalar", -1.5, false},
      {UnaryOp::RSubScalar, "rsub_scalar", 2.0, false},
  };
  uint32_t seed = 10;
  for (DType dtype : {kFloat32, kBFloat16, kFloat16}) {
    for (const Case& c : cases) {
      // A transposed view: the strided path.
      const Twin base = random_twin({33, 7}, dtype, ++seed, c.positive ? 0.1 : -3.0, 3.0);
      const Twin x = view(base, {7, 33}, {1, 7});
      const Twin out = output_twin({7, 33}, dtype);
      cpu::unary(c.op, x.cpu, out.cpu, c.scalar);
      cuda::unary(c.op, x.gpu, out.gpu, c.scalar);
      expect_near(out.gpu, out.cpu, tol(dtype, 2e-6), 1e-7, std::string(c.label) + " " + name(dtype));
    }
  }
  for (DType dtype : {kInt64, kInt32}) {
    for (const Case& c : cases) {
      if (c.positive || c.op == UnaryOp::Exp || c.op == UnaryOp::Tanh || c.op == UnaryOp::Sigmoid)
        continue;
      const Twin x = random_twin({5, 41}, dtype, ++seed, -50, 50);
      const Twin out = output_twin({5, 41}, dtype);
      cpu::unary(c.op, x.cpu, out.cpu, c.scalar);
      cuda::unary(c.op, x.gpu, out.gpu, c.scalar);
      expect_equal(out.gpu, out.cpu, std::string(c.label) + " " + name(dtype));
    }
  }
}

TEST(CudaKernels, GtScalarWritesBool_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  for (DType dtype : {kFloat32, kBFloat16, kInt32, kInt64}) {
    const Twin x = random_twin({17, 19}, dtype, 20, -3, 3, Values::Halves);
    const Twin out = output_twin({17, 19}, kBool);
    cpu::unary(UnaryOp::GtScalar, x.cpu, out.cpu, 0.5);
    cuda::unary(UnaryOp::GtScalar, x.gpu, out.gpu, 0.5);
    expect_equal(out.gpu, out.cpu, "gt_scalar " + name(dtype));
  }
}

TEST(CudaKernels, BinaryMatchesCpuOnStridedAndBroadcastOperands_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  struct Case {
    BinaryOp op;
    const char* label;
    double alpha;
  };
  const Case arithmetic[] = {
      {BinaryOp::Add, "add", 0.5},          {BinaryOp::Sub, "sub", 2.0},
      {BinaryOp::Mul, "mul", 1.0},          {BinaryOp::Div, "div", 1.0},
      {BinaryOp::Max, "max", 1.0},          {BinaryOp::Min, "min", 1.0},
      {BinaryOp::ReluGrad, "relu_grad", 1.0}, {BinaryOp::TanhGrad, "tanh_grad", 1.0},
      {BinaryOp::SigmoidGrad, "sigmoid_grad", 1.0},
  };
  const Case comparisons[] = {{BinaryOp::Eq, "eq", 1}, {BinaryOp::Ne, "ne", 1},
                              {BinaryOp::Lt, "lt", 1}, {BinaryOp::Le, "le", 1},
                              {BinaryOp::Gt, "gt", 1}, {BinaryOp::Ge, "ge", 1}};
  uint32_t seed = 30;
  for (DType dtype : {kFloat32, kBFloat16, kFloat16, kInt64, kInt32}) {
    const bool integer = !is_floating(dtype);
    for (const Case& c : arithmetic) {
      if (integer && (c.op == BinaryOp::TanhGrad || c.op == BinaryOp::SigmoidGrad)) continue;
      const bool div = c.op == BinaryOp::Div;
      // a: transposed [12, 9]; b: a row broadcast over dim 0 (stride 0).
      const Twin a_base = random_twin({9, 12}, dtype, ++seed, -20, 20);
      const Twin b_base = random_twin({9}, dtype, ++seed, div ? 1 : -20, div ? 7 : 20);
      const Twin a = view(a_base, {12, 9}, {1, 12});
      const Twin b = view(b_base, {12, 9}, {0, 1});
      const Twin out = output_twin({12, 9}, dtype);
      cpu::binary(c.op, a.cpu, b.cpu, out.cpu, c.alpha);
      cuda::binary(c.op, a.gpu, b.gpu, out.gpu, c.alpha);
      const std::string what = std::string(c.label) + " " + name(dtype);
      if (integer) expect_equal(out.gpu, out.cpu, what);
      else expect_near(out.gpu, out.cpu, tol(dtype, 2e-6), 1e-6, what);
    }
    for (const Case& c : comparisons) {
      // Small integers, so that ties occur.
      const Twin a = random_twin({7, 11}, dtype, ++seed, -2, 2, Values::Integers);
      const Twin b = random_twin({7, 11}, dtype, ++seed, -2, 2, Values::Integers);
      const Twin out = output_twin({7, 11}, kBool);
      cpu::binary(c.op, a.cpu, b.cpu, out.cpu, 1.0);
      cuda::binary(c.op, a.gpu, b.gpu, out.gpu, 1.0);
      expect_equal(out.gpu, out.cpu, std::string(c.label) + " " + name(dtype));
    }
  }
}

// Long contiguous operands take the vectorised kernel (with a scalar tail);
// an operand offset by one element is misaligned and takes the scalar one.
TEST(CudaKernels, ContiguousFastPathsMatchCpu_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const int64_t n = (1 << 16) + 3;
  for (DType dtype : {kFloat32, kBFloat16, kUInt8}) {
    for (int64_t offset : {0, 1}) {
      const Twin a_base = random_twin({n + 1}, dtype, 40, 0, 100);
      const Twin b = random_twin({n}, dtype, 41, 0, 100);
      const Twin a = view(a_base, {n}, {1}, offset);
      const Twin out = output_twin({n}, dtype);
      cpu::binary(BinaryOp::Max, a.cpu, b.cpu, out.cpu, 1.0);
      cuda::binary(BinaryOp::Max, a.gpu, b.gpu, out.gpu, 1.0);
      expect_equal(out.gpu, out.cpu, "max " + name(dtype) + " offset " + std::to_string(offset));

      // In place: out aliases a.
      cpu::binary(BinaryOp::Add, a.cpu, b.cpu, a.cpu, 1.0);
      cuda::binary(BinaryOp::Add, a.gpu, b.gpu, a.gpu, 1.0);
      expect_near(a.gpu, a.cpu, tol(dtype, 0.0), 0.0, "in-place add " + name(dtype));
    }
  }
}

// ---- copy, fill ----------------------------------------------------------------------------------

TEST(CudaKernels, CopyConvertsBetweenEveryPairOfDtypes_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 50;
  for (DType from : kAllDtypes) {
    for (DType to : kAllDtypes) {
      // Halves in [0, 100]: exact in every floating dtype, truncated by integers.
      const Twin base = random_twin({10, 13}, from, ++seed, 0, 100, Values::Halves);
      const Twin src = view(base, {13, 10}, {1, 13});
      const Twin dst = output_twin({13, 10}, to);
      cpu::copy(src.cpu, dst.cpu);
      cuda::copy(src.gpu, dst.gpu);
      expect_equal(dst.gpu, dst.cpu, "copy " + name(from) + " -> " + name(to));
    }
  }
}

TEST(CudaKernels, CopyIntoStridedDestination_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  for (DType from : {kFloat32, kBFloat16, kInt64}) {
    const Twin src = random_twin({6, 8}, from, 60, -10, 10);
    const Twin dst_base = output_twin({8, 6}, kFloat32);
    const Twin dst = view(dst_base, {6, 8}, {1, 6});
    cpu::copy(src.cpu, dst.cpu);
    cuda::copy(src.gpu, dst.gpu);
    expect_equal(dst_base.gpu, dst_base.cpu, "copy into a transposed view from " + name(from));
  }
  // Same dtype, both contiguous: a plain device-to-device copy.
  const Twin src = random_twin({1000}, kFloat32, 61);
  const Twin dst = output_twin({1000}, kFloat32);
  cpu::copy(src.cpu, dst.cpu);
  cuda::copy(src.gpu, dst.gpu);
  expect_equal(dst.gpu, dst.cpu, "contiguous copy");
}

// Note [Elementwise dims in the output's memory order]: operands of one dense
// layout other than row-major (channels-last, a permuted 3-d tensor) walk
// memory in order; a channels-last output with a row-major input, a
// broadcast (stride 0) input, and odd sizes (the vectorised kernel's tail).
TEST(CudaKernels, PermutedLayoutsMatchCpu_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const int64_t n = 3, c = 37, h = 5, w = 7;
  const Shape sizes{n, c, h, w}, cl_strides{h * w * c, 1, w * c, c};
  for (DType from : {kFloat32, kBFloat16}) {
    for (DType to : {kFloat32, kBFloat16, kFloat16}) {
      const std::string what = name(from) + " -> " + name(to);
      // Both channels-last: a conversion in memory order.
      const Twin src = view(random_twin({n * c * h * w}, from, 70, -10, 10), sizes, cl_strides);
      const Twin dst_base = output_twin({n * c * h * w}, to);
      const Twin dst = view(dst_base, sizes, cl_strides);
      cpu::copy(src.cpu, dst.cpu);
      cuda::copy(src.gpu, dst.gpu);
      expect_equal(dst_base.gpu, dst_base.cpu, "channels-last copy " + what);
      // Row-major into channels-last, and back.
      const Twin rm = random_twin(sizes, from, 71, -10, 10);
      const Twin cl_base = output_twin({n * c * h * w}, to);
      cpu::copy(rm.cpu, view(cl_base, sizes, cl_strides).cpu);
      cuda::copy(rm.gpu, view(cl_base, sizes, cl_strides).gpu);
      expect_equal(cl_base.gpu, cl_base.cpu, "row-major -> channels-last " + what);
      const Twin back = output_twin(sizes, to);
      cpu::copy(src.cpu, back.cpu);
      cuda::copy(src.gpu, back.gpu);
      expect_equal(back.gpu, back.cpu, "channels-last -> row-major " + what);
    }
  }
  // A binary op: channels-last a, a per-channel b broadcast over N, H, W, and a
  // permuted 3-d pair ([4, 9, 6] stored as [6][4][9]).
  const Twin a = view(random_twin({n * c * h * w}, kFloat32, 72), sizes, cl_strides);
  const Twin b = view(random_twin({c}, kFloat32, 73), sizes, {0, 1, 0, 0});
  const Twin out_base = output_twin({n * c * h * w}, kFloat32);
  const Twin out = view(out_base, sizes, cl_strides);
  cpu::binary(BinaryOp::Mul, a.cpu, b.cpu, out.cpu, 1.0);
  cuda::binary(BinaryOp::Mul, a.gpu, b.gpu, out.gpu, 1.0);
  expect_near(out_base.gpu, out_base.cpu, 0.0, 0.0, "channels-last times a broadcast channel vector");
  const Shape p_sizes{4, 9, 6}, p_strides{9, 1, 36};
  const Twin x = view(random_twin({216}, kBFloat16, 74), p_sizes, p_strides);
  const Twin y = view(random_twin({216}, kBFloat16, 75), p_sizes, p_strides);
  const Twin z_base = output_twin({216}, kBFloat16);
  const Twin z = view(z_base, p_sizes, p_strides);
  cpu::binary(BinaryOp::Add, x.cpu, y.cpu, z.cpu, 1.0);
  cuda::binary(BinaryOp::Add, x.gpu, y.gpu, z.gpu, 1.0);
  expect_near(z_base.gpu, z_base.cpu, 1e-2, 0.0, "permuted 3-d add");
}

// Note [Rows of contiguous elements] (cuda/kernels/elementwise.cu): strided walks whose
// innermost dim is contiguous in every operand take 16-byte vectors --
// attention's head permute [B, T, H, D] -> [B, H, T, D] (also converting), a
// bias row broadcast over rows, and an input repeated along the rows.
TEST(CudaKernels, RowsOfContiguousElementsMatchCpu_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const int64_t b = 2, t = 5, h = 3, d = 64;
  const Shape perm_sizes{b, h, t, d}, perm_strides{t * h * d, d, h * d, 1};
  for (DType from : {kFloat32, kBFloat16}) {
    for (DType to : {kFloat32, kBFloat16}) {
      const Twin src = view(random_twin({b * t * h * d}, from, 80, -10, 10), perm_sizes, perm_strides);
      const Twin dst = output_twin(perm_sizes, to);
      cpu::copy(src.cpu, dst.cpu);
      cuda::copy(src.gpu, dst.gpu);
      expect_equal(dst.gpu, dst.cpu, "head permute " + name(from) + " -> " + name(to));
    }
  }
  for (DType dt : {kFloat32, kBFloat16}) {
    const Twin x = random_twin({7, 96}, dt, 81);
    const Twin bias = view(random_twin({96}, dt, 82), {7, 96}, {0, 1});
    const Twin out = output_twin({7, 96}, dt);
    cpu::binary(BinaryOp::Add, x.cpu, bias.cpu, out.cpu, 1.0);
    cuda::binary(BinaryOp::Add, x.gpu, bias.gpu, out.gpu, 1.0);
    expect_near(out.gpu, out.cpu, dt == kFloat32 ? 0.0 : 1e-2, 0.0, "bias broadcast over rows " + name(dt));
    const Twin scale = view(random_twin({1}, dt, 83), {7, 96}, {0, 0});
    const Twin prod = output_twin({7, 96}, dt);
    cpu::binary(BinaryOp::Mul, x.cpu, scale.cpu, prod.cpu, 1.0);
    cuda::binary(BinaryOp::Mul, x.gpu, scale.gpu, prod.gpu, 1.0);
    expect_near(prod.gpu, prod.cpu, dt == kFloat32 ? 0.0 : 1e-2, 0.0, "a repeated scalar " + name(dt));
  }
}

TEST(CudaKernels, FillWritesOnlyTheView_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  for (DType dtype : kAllDtypes) {
    const Twin base = random_twin({10, 12}, dtype, 70, 0, 9);
    const Twin every_other_column = view(base, {10, 6}, {12, 2}, 1);
    cpu::fill(every_other_column.cpu, 2.5);
    cuda::fill(every_other_column.gpu, 2.5);
    expect_equal(base.gpu, base.cpu, "fill " + name(dtype));
  }
}

// ---- reductions ------------------------------------------------------------------------------------

Shape reduced_shape(const Shape& s, const std::vector<bool>& mask) {
  Shape out = s;
  for (size_t d = 0; d < s.size(); ++d)
    if (mask[d]) out[d] = 1;
  return out;
}

void check_reduce(ReduceOp op, const Twin& x, const std::vector<bool>& mask, double rtol,
                  double atol, const std::string& what) {
  const bool arg = op == ReduceOp::Argmax || op == ReduceOp::Argmin;
  const Twin out = output_twin(reduced_shape(x.cpu.sizes(), mask), arg ? kInt64 : x.cpu.dtype());
  cpu::reduce(op, x.cpu, out.cpu, mask);
  cuda::reduce(op, x.gpu, out.gpu, mask);
  std::string dims;
  for (bool m : mask) dims += m ? "R" : ".";
  expect_near(out.gpu, out.cpu, rtol, atol, what + " over " + dims);
}

TEST(CudaKernels, ReduceMatchesCpuOverAnyDims_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const std::vector<std::vector<bool>> masks = {
      {false, false, false, true}, {true, false, false, false}, {true, false, true, true},
      {true, true, true, true},    {false, true, false, false}, {false, true, false, true},
      {false, false, false, false}};
  const std::pair<ReduceOp, const char*> ops[] = {
      {ReduceOp::Sum, "sum"}, {ReduceOp::Mean, "mean"}, {ReduceOp::Max, "max"}, {ReduceOp::Min, "min"}};
  uint32_t seed = 80;
  for (DType dtype : {kFloat32, kBFloat16, kInt64, kInt32}) {
    const double rtol = is_floating(dtype) ? tol(dtype, 1e-5) : 0.0;
    const double atol = is_floating(dtype) ? tol(dtype, 1e-6) : 0.0;
    for (bool transposed : {false, true}) {
      // [4, 6, 5, 7], either contiguous or a permuted view of a [7, 5, 6, 4] tensor.
      // Non-negative values: sums without cancellation, so relative errors stay small.
      Twin x = random_twin({4, 6, 5, 7}, dtype, ++seed, 0, 10);
      if (transposed) {
        const Twin base = random_twin({7, 5, 6, 4}, dtype, ++seed, 0, 10);
        x = view(base, {4, 6, 5, 7}, {1, 4, 24, 120});
      }
      for (const auto& [op, label] : ops) {
        for (const auto& mask : masks) {
          check_reduce(op, x, mask, rtol, atol,
                       std::string(label) + " " + name(dtype) + (transposed ? " (permuted)" : ""));
        }
      }
    }
  }
}

TEST(CudaKernels, ReduceLargeTensorsSplitAcrossBlocks_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  // Full reduction: many blocks write partial results, a second kernel combines them.
  const Twin flat = random_twin({1 << 22}, kFloat32, 90, 0, 1);
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min})
    check_reduce(op, flat, {true}, 1e-5, 0.0, "full reduction of 4M");
  // Column layout (outputs adjacent), split over blocks.
  const Twin tall = random_twin({1 << 16, 64}, kFloat32, 91, 0, 1);
  check_reduce(ReduceOp::Sum, tall, {true, false}, 1e-5, 1e-5, "[65536, 64] sum");
  check_reduce(ReduceOp::Max, tall, {true, false}, 0.0, 0.0, "[65536, 64] max");
  // Long rows, one block per row, split.
  const Twin wide = random_twin({64, 1 << 16}, kFloat32, 92, 0, 1);
  check_reduce(ReduceOp::Sum, wide, {false, true}, 1e-5, 1e-5, "[64, 65536] sum");
  // Per-channel sums of NCHW (two reduced dims that do not merge), and of bf16.
  const Twin nchw = random_twin({8, 32, 16, 16}, kFloat32, 93, 0, 1);
  check_reduce(ReduceOp::Sum, nchw, {true, false, true, true}, 1e-5, 1e-5, "per-channel sum");
  const Twin nchw16 = random_twin({8, 32, 16, 16}, kBFloat16, 94, 0, 1);
  check_reduce(ReduceOp::Mean, nchw16, {true, false, true, true}, 1e-2, 1e-2, "per-channel mean");
  // Sums over leading dims as column sums (Note [Leading dimensions summed
  // as columns] in cuda/kernels/reduce.cu): a GPT position embedding's
  // gradient over the batch in bf16, two leading dims in float32, and a
  // width of no 16-byte vectors.
  const Twin pos16 = random_twin({16, 64, 768}, kBFloat16, 95, 0, 1);
  check_reduce(ReduceOp::Sum, pos16, {true, false, false}, 1e-2, 1e-2, "batch sum of [16, 64, 768] bf16");
  const Twin lead2 = random_twin({12, 40, 96}, kFloat32, 96, 0, 1);
  check_reduce(ReduceOp::Sum, lead2, {true, true, false}, 1e-5, 1e-5, "sum of [12, 40, 96] over two dims");
  const Twin odd = random_twin({300, 7}, kFloat32, 97, 0, 1);
  check_reduce(ReduceOp::Sum, odd, {true, false}, 1e-5, 1e-5, "[300, 7] column sums");
}

TEST(CudaKernels, ArgmaxAndArgminPickTheFirstOfTies_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 100;
  for (DType dtype : {kFloat32, kBFloat16, kInt32}) {
    // Values in {0, 1, 2}: every row has ties.
    const Twin x = random_twin({4, 6, 5, 7}, dtype, ++seed, 0, 2, Values::Integers);
    for (size_t d = 0; d < 4; ++d) {
      std::vector<bool> mask(4, false);
      mask[d] = true;
      check_reduce(ReduceOp::Argmax, x, mask, 0, 0, "argmax " + name(dtype));
      check_reduce(ReduceOp::Argmin, x, mask, 0, 0, "argmin " + name(dtype));
    }
  }
  // Long rows and long columns, split across blocks.
  const Twin rows = random_twin({2, 100000}, kFloat32, 110, 0, 1000, Values::Integers);
  check_reduce(ReduceOp::Argmax, rows, {false, true}, 0, 0, "argmax of long rows");
  check_reduce(ReduceOp::Argmin, rows, {false, true}, 0, 0, "argmin of long rows");
  const Twin cols = random_twin({100000, 3}, kFloat32, 111, 0, 1000, Values::Integers);
  check_reduce(ReduceOp::Argmax, cols, {true, false}, 0, 0, "argmax of long columns");
}

// ---- random ------------------------------------------------------------------------------------------

TEST(CudaKernels, RandomFillsMatchCpuForTheSameState_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const RngState rng{1234, 77};
  const int64_t n = 1001;  // not a multiple of the 4 words of a Philox block
  for (DType dtype : {kFloat32, kBFloat16, kFloat16}) {
    const Twin u = output_twin({n}, dtype);
    cpu::uniform(u.cpu, -1.5, 2.5, rng);
    cuda::uniform(u.gpu, -1.5, 2.5, rng);
    expect_equal(u.gpu, u.cpu, "uniform " + name(dtype));

    const Twin m = output_twin({n}, dtype);
    cpu::dropout_mask(m.cpu, 0.3, rng);
    cuda::dropout_mask(m.gpu, 0.3, rng);
    expect_equal(m.gpu, m.cpu, "dropout_mask " + name(dtype));

    const Twin z = output_twin({n}, dtype);
    cpu::normal(z.cpu, 0.5, 2.0, rng);
    cuda::normal(z.gpu, 0.5, 2.0, rng);
    expect_near(z.gpu, z.cpu, tol(dtype, 1e-5), 1e-6, "normal " + name(dtype));
  }
  for (DType dtype : {kInt64, kInt32, kFloat32}) {
    const Twin r = output_twin({n}, dtype);
    cpu::randint(r.cpu, -5, 17, rng);
    cuda::randint(r.gpu, -5, 17, rng);
    expect_equal(r.gpu, r.cpu, "randint " + name(dtype));
  }
  // Another offset gives other numbers.
  const Twin a = output_twin({n}, kFloat32), b = output_twin({n}, kFloat32);
  cuda::uniform(a.gpu, 0, 1, rng);
  cuda::uniform(b.gpu, 0, 1, RngState{rng.seed, rng.offset + 1000});
  EXPECT_NE(values(a.gpu), values(b.gpu));
}

// ---- softmax, cross entropy ------------------------------------------------------------------------

TEST(CudaKernels, SoftmaxForwardAndBackwardMatchCpu_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 120;
  // [13, 10]: a warp per row; [5, 3000]: a block per row; [3, 4, 33]: rows of a 3-d tensor.
  for (const Shape& shape : {Shape{13, 10}, Shape{5, 3000}, Shape{3, 4, 33}}) {
    for (DType dtype : {kFloat32, kBFloat16}) {
      for (bool log : {false, true}) {
        const std::string what = std::string(log ? "log_softmax " : "softmax ") + name(dtype) +
                                 " " + shape_str(shape);
        const Twin x = random_twin(shape, dtype, ++seed, -8, 8);
        const Twin y = output_twin(shape, dtype);
        cpu::softmax_forward(x.cpu, y.cpu, log);
        cuda::softmax_forward(x.gpu, y.gpu, log);
        expect_near(y.gpu, y.cpu, tol(dtype, 1e-5), tol(dtype, 1e-6), what);

        // Backward from the same y on both sides.
        const Twin y_in = random_twin(shape, dtype, ++seed, log ? -5 : 0, log ? 0 : 1);
        const Twin dy = random_twin(shape, dtype, ++seed, -1, 1);
        const Twin dx = output_twin(shape, dtype);
        cpu::softmax_backward(dy.cpu, y_in.cpu, dx.cpu, log);
        cuda::softmax_backward(dy.gpu, y_in.gpu, dx.gpu, log);
        expect_near(dx.gpu, dx.cpu, tol(dtype, 1e-5), tol(dtype, 1e-6), what + " backward");
      }
    }
  }
}

TEST(CudaKernels, CrossEntropyMatchesCpu_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 140;
  for (const Shape& shape : {Shape{11, 10}, Shape{4, 2500}}) {
    const int64_t b = shape[0], c = shape[1];
    for (DType dtype : {kFloat32, kBFloat16}) {
      for (double smoothing : {0.0, 0.1}) {
        const std::string what = "cross_entropy " + name(dtype) + " " + shape_str(shape) +
                                 " smoothing " + std::to_string(smoothing);
        const Twin logits = random_twin(shape, dtype, ++seed, -6, 6);
        const Twin target = random_twin({b}, kInt64, ++seed, 0, static_cast<double>(c - 1));
        const Twin losses = output_twin({b}, kFloat32);
        const Twin probs = output_twin(shape, kFloat32);
        cpu::cross_entropy_forward(logits.cpu, target.cpu, smoothing, losses.cpu, probs.cpu);
        cuda::cross_entropy_forward(logits.gpu, target.gpu, smoothing, losses.gpu, probs.gpu);
        expect_near(losses.gpu, losses.cpu, 1e-5, 1e-6, what + " losses");
        expect_near(probs.gpu, probs.cpu, 1e-5, 1e-6, what + " probs");

        const Twin dloss = random_twin({b}, kFloat32, ++seed, -1, 1);
        for (DType out_dtype : {kFloat32, dtype}) {
          const Twin dlogits = output_twin(shape, out_dtype);
          cpu::cross_entropy_backward(dloss.cpu, probs.cpu, target.cpu, smoothing, dlogits.cpu);
          cuda::cross_entropy_backward(dloss.gpu, probs.gpu, target.gpu, smoothing, dlogits.gpu);
          expect_near(dlogits.gpu, dlogits.cpu, tol(out_dtype, 1e-5), tol(out_dtype, 1e-6),
                      what + " backward to " + name(out_dtype));
        }
      }
    }
  }
}

// ---- indexing -------------------------------------------------------------------------------------

Twin index_twin(const std::vector<int64_t>& idx, const Shape& shape) {
  Twin t = random_twin(shape, kInt64, 0, 0, 0);
  std::copy(idx.begin(), idx.end(), t.cpu.data<int64_t>());
  backend(kGpu).copy(t.gpu.raw_data(), kGpu, t.cpu.raw_data(), kHost, t.cpu.nbytes());
  return t;
}

Twin random_index(const Shape& shape, int64_t size, uint32_t seed) {
  return random_twin(shape, kInt64, seed, 0, static_cast<double>(size - 1));
}

TEST(CudaKernels, IndexSelectAndIndexAddMatchCpu_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const Twin index = index_twin({7, 0, 3, 3, 5, 1}, {6});  // repeats
  uint32_t seed = 160;
  for (DType dtype : {kFloat32, kBFloat16, kInt64, kUInt8}) {
    const Twin x = random_twin({3, 8, 5}, dtype, ++seed, 0, 9);
    for (int64_t dim : {1, -1}) {
      Shape out_shape = {3, 8, 5};
      out_shape[dim == 1 ? 1 : 2] = 6;
      const Twin out = output_twin(out_shape, dtype);
      const Twin idx = dim == 1 ? index : index_twin({4, 0, 2, 2, 1, 3}, {6});
      cpu::index_select(x.cpu, dim, idx.cpu, out.cpu);
      cuda::index_select(x.gpu, dim, idx.gpu, out.gpu);
      expect_equal(out.gpu, out.cpu, "index_select " + name(dtype) + " dim " + std::to_string(dim));
    }
    // out[:, index[k], :] += src[:, k, :], with index 3 twice.
    const Twin acc = random_twin({3, 8, 5}, dtype, ++seed, 0, 9);
    const Twin src = random_twin({3, 6, 5}, dtype, ++seed, 0, 9);
    cpu::index_add(acc.cpu, 1, index.cpu, src.cpu);
    cuda::index_add(acc.gpu, 1, index.gpu, src.gpu);
    expect_near(acc.gpu, acc.cpu, dtype == kFloat32 ? 1e-6 : 0.0, 0.0, "index_add " + name(dtype));
  }
  // Embedding-style: rows of a [1000, 64] table (Note [Whole rows of 16
  // bytes] in cuda/kernels/index.cu: 16-byte words, float4 atomics), of bf16
  // rows, and of rows of 24 bytes (the element kernels).
  const Twin ids = random_index({4096}, 1000, 171);
  uint32_t tseed = 172;
  for (const auto& [dtype, width] : {std::pair{kFloat32, int64_t{64}}, std::pair{kBFloat16, int64_t{64}},
                                     std::pair{kFloat32, int64_t{6}}}) {
    const std::string what = name(dtype) + " rows of " + std::to_string(width);
    const Twin table = random_twin({1000, width}, dtype, ++tseed);
    const Twin rows = output_twin({4096, width}, dtype);
    cpu::index_select(table.cpu, 0, ids.cpu, rows.cpu);
    cuda::index_select(table.gpu, 0, ids.gpu, rows.gpu);
    expect_equal(rows.gpu, rows.cpu, "embedding lookup, " + what);
    if (dtype != kFloat32) continue;
    const Twin grad = random_twin({1000, width}, kFloat32, ++tseed);
    cpu::index_add(grad.cpu, 0, ids.cpu, rows.cpu);
    cuda::index_add(grad.gpu, 0, ids.gpu, rows.gpu);
    expect_near(grad.gpu, grad.cpu, 1e-5, 1e-6, "embedding gradient, " + what);
  }
  // A table whose data starts 4 bytes past a 16-byte boundary (a view at
  // offset 1): whole rows of 256 bytes, but the element kernels.
  const Twin padded = random_twin({1000 * 64 + 1}, kFloat32, 180);
  const Twin shifted = view(padded, {1000, 64}, {64, 1}, 1);
  const Twin picked = output_twin({4096, 64}, kFloat32);
  cpu::index_select(shifted.cpu, 0, ids.cpu, picked.cpu);
  cuda::index_select(shifted.gpu, 0, ids.gpu, picked.gpu);
  expect_equal(picked.gpu, picked.cpu, "embedding lookup from a table at an odd offset");
  const Twin back = random_twin({1000 * 64 + 1}, kFloat32, 181);
  const Twin back_view = view(back, {1000, 64}, {64, 1}, 1);
  cpu::index_add(back_view.cpu, 0, ids.cpu, picked.cpu);
  cuda::index_add(back_view.gpu, 0, ids.gpu, picked.gpu);
  expect_near(back_view.gpu, back_view.cpu, 1e-5, 1e-6, "embedding gradient into a table at an odd offset");
  // Indices out of range on the row paths: a selected row is zeros, an added
  // row is skipped (the CPU refuses them, so the expectation is built here).
  const Twin table = random_twin({10, 64}, kFloat32, 182);
  const Twin bad = index_twin({3, -1, 10, 7}, {4});
  const Twin got = output_twin({4, 64}, kFloat32);
  cuda::index_select(table.gpu, 0, bad.gpu, got.gpu);
  const std::vector<double> t = values(table.gpu), g = values(got.gpu);
  for (int64_t c = 0; c < 64; ++c) {
    EXPECT_EQ(g[static_cast<size_t>(c)], t[static_cast<size_t>(3 * 64 + c)]) << "row 0, column " << c;
    EXPECT_EQ(g[static_cast<size_t>(64 + c)], 0.0) << "index -1, column " << c;
    EXPECT_EQ(g[static_cast<size_t>(128 + c)], 0.0) << "index 10, column " << c;
    EXPECT_EQ(g[static_cast<size_t>(192 + c)], t[static_cast<size_t>(7 * 64 + c)]) << "row 3, column " << c;
  }
  const Twin sums = random_twin({10, 64}, kFloat32, 183);
  const std::vector<double> before = values(sums.gpu), src = values(got.gpu);
  cuda::index_add(sums.gpu, 0, bad.gpu, got.gpu);
  std::vector<double> want = before;
  for (int64_t c = 0; c < 64; ++c) {
    want[static_cast<size_t>(3 * 64 + c)] = static_cast<float>(want[static_cast<size_t>(3 * 64 + c)] + src[static_cast<size_t>(c)]);
    want[static_cast<size_t>(7 * 64 + c)] =
        static_cast<float>(want[static_cast<size_t>(7 * 64 + c)] + src[static_cast<size_t>(192 + c)]);
  }
  EXPECT_EQ(values(sums.gpu), want) << "index_add with indices -1 and 10 skipped";
}

TEST(CudaKernels, GatherAndScatterAddMatchCpu_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 180;
  for (DType dtype : {kFloat32, kBFloat16, kInt64, kInt32}) {
    const Twin x = random_twin({4, 9, 6}, dtype, ++seed, -9, 9);
    // The index is smaller than x in every dim, as PyTorch allows.
    const Twin index = random_index({3, 5, 4}, 9, ++seed);
    const Twin out = output_twin({3, 5, 4}, dtype);
    cpu::gather(x.cpu, 1, index.cpu, out.cpu);
    cuda::gather(x.gpu, 1, index.gpu, out.gpu);
    expect_equal(out.gpu, out.cpu, "gather " + name(dtype));

    const Twin acc = random_twin({4, 9, 6}, dtype, ++seed, -9, 9);
    const Twin src = random_twin({4, 5, 6}, dtype, ++seed, -9, 9);  // larger than the index
    cpu::scatter_add(acc.cpu, 1, index.cpu, src.cpu);
    cuda::scatter_add(acc.gpu, 1, index.gpu, src.gpu);
    // Repeated indices add in a GPU-chosen order: float32 sums differ in the
    // last bits, and bf16 rounds every partial sum to 8 bits (~1e-2 relative).
    const double rtol = dtype == kFloat32 ? 1e-6 : dtype == kBFloat16 ? 2e-2 : 0.0;
    const double atol = dtype == kFloat32 ? 1e-7 : dtype == kBFloat16 ? 1e-2 : 0.0;
    expect_near(acc.gpu, acc.cpu, rtol, atol,
                "scatter_add " + name(dtype));
  }
  // Gather along the last dim (the cross-entropy pattern) of a larger tensor.
  const Twin x = random_twin({512, 100}, kFloat32, 190);
  const Twin index = random_index({512, 1}, 100, 191);
  const Twin out = output_twin({512, 1}, kFloat32);
  cpu::gather(x.cpu, -1, index.cpu, out.cpu);
  cuda::gather(x.gpu, -1, index.gpu, out.gpu);
  expect_equal(out.gpu, out.cpu, "gather along the last dim");
}

}  // namespace
}  // namespace chorus

#endif  // CHORUS_WITH_CUDA
