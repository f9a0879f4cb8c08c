// Twins for the CUDA kernel tests: a host tensor and a byte-identical copy
// on the GPU with the same geometry, made, viewed and compared alike (the
// tolerances elementwise_test.cpp's header explains). Shared by the kernel
// tests that compare the CUDA kernel set with the CPU one.
#pragma once

#ifdef CHORUS_WITH_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "chorus/core/backend.h"
#include "chorus/core/tensor.h"

namespace chorus::cuda_twins {

inline const Device kGpu = cuda_device(0);
inline const Device kHost = cpu_device(0);

// ---- reading and writing elements of any dtype -------------------------------------------

inline double read_element(const char* p, DType t) {
  switch (t) {
    case kFloat32: return *reinterpret_cast<const float*>(p);
    case kBFloat16: return static_cast<float>(*reinterpret_cast<const BFloat16*>(p));
    case kFloat16: return static_cast<float>(*reinterpret_cast<const Float16*>(p));
    case kInt64: return static_cast<double>(*reinterpret_cast<const int64_t*>(p));
    case kInt32: return *reinterpret_cast<const int32_t*>(p);
    case kUInt8: return *reinterpret_cast<const uint8_t*>(p);
    case kBool: return *reinterpret_cast<const bool*>(p) ? 1.0 : 0.0;
    default: ADD_FAILURE() << "read_element: dtype " << dtype_name(t); return 0.0;
  }
}

inline void write_element(char* p, DType t, double v) {
  switch (t) {
    case kFloat32: *reinterpret_cast<float*>(p) = static_cast<float>(v); break;
    case kBFloat16: *reinterpret_cast<BFloat16*>(p) = BFloat16(static_cast<float>(v)); break;
    case kFloat16: *reinterpret_cast<Float16*>(p) = Float16(static_cast<float>(v)); break;
    case kInt64: *reinterpret_cast<int64_t*>(p) = static_cast<int64_t>(v); break;
    case kInt32: *reinterpret_cast<int32_t*>(p) = static_cast<int32_t>(v); break;
    case kUInt8: *reinterpret_cast<uint8_t*>(p) = static_cast<uint8_t>(v); break;
    case kBool: *reinterpret_cast<bool*>(p) = v != 0.0; break;
    default: ADD_FAILURE() << "write_element: dtype " << dtype_name(t);
  }
}

// ---- twins: one tensor on the host, a byte-identical one on the GPU ------------------------

struct Twin {
  Tensor cpu, gpu;
};

enum class Values { Real, Integers, Halves };

// Contiguous twins of random values: Real draws uniformly from [lo, hi),
// Integers from the integers in [lo, hi], Halves from the multiples of 0.5 in
// [lo, hi] (exact in every floating dtype). Integer dtypes always hold
// integers, bool a fair coin.
inline Twin random_twin(const Shape& shape, DType dtype, uint32_t seed, double lo = -2.0, double hi = 2.0,
                 Values kind = Values::Real) {
  Tensor h = detail::empty_tensor(shape, dtype, kHost);
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> real(lo, hi);
  std::uniform_int_distribution<int64_t> ints(static_cast<int64_t>(std::ceil(lo)),
                                              static_cast<int64_t>(std::floor(hi)));
  std::uniform_int_distribution<int64_t> halves(static_cast<int64_t>(std::ceil(2 * lo)),
                                                static_cast<int64_t>(std::floor(2 * hi)));
  char* p = static_cast<char*>(h.raw_data());
  for (int64_t i = 0; i < h.numel(); ++i) {
    double v;
    if (dtype == kBool) v = static_cast<double>(gen() & 1u);
    else if (!is_floating(dtype) || kind == Values::Integers) v = static_cast<double>(ints(gen));
    else if (kind == Values::Halves) v = 0.5 * static_cast<double>(halves(gen));
    else v = real(gen);
    write_element(p + i * static_cast<int64_t>(h.element_size()), dtype, v);
  }
  Tensor d = detail::empty_tensor(shape, dtype, kGpu);
  backend(kGpu).copy(d.raw_data(), kGpu, h.raw_data(), kHost, h.nbytes());
  return {h, d};
}

// Note [Optimizer scalars on the device]: a float32 [lr, step] on the GPU.
inline Tensor gpu_scalars(double lr, double step) {
  Tensor h = detail::empty_tensor({2}, kFloat32, kHost);
  h.data<float>()[0] = static_cast<float>(lr);
  h.data<float>()[1] = static_cast<float>(step);
  Tensor d = detail::empty_tensor({2}, kFloat32, kGpu);
  backend(kGpu).copy(d.raw_data(), kGpu, h.raw_data(), kHost, h.nbytes());
  return d;
}

// Twins that a kernel will overwrite (their initial contents match too).
inline Twin output_twin(const Shape& shape, DType dtype) { return random_twin(shape, dtype, 4242, 50, 60); }

inline Twin view(const Twin& t, const Shape& sizes, const Shape& strides, int64_t offset = 0) {
  return {detail::make_view(t.cpu, sizes, strides, offset),
          detail::make_view(t.gpu, sizes, strides, offset)};
}

// The elements of any tensor, host or GPU, in row-major order.
inline std::vector<double> values(const Tensor& t) {
  Tensor h = t;
  if (t.device().is_cuda()) {
    const size_t bytes = t.storage()->nbytes();
    Tensor base = detail::empty_tensor({static_cast<int64_t>(bytes / t.element_size())}, t.dtype(),
                                       kHost);
    backend(kGpu).copy(base.raw_data(), kHost, t.storage()->data(), kGpu, bytes);
    h = detail::make_view(base, t.sizes(), t.strides(), t.storage_offset());
  }
  std::vector<double> out;
  out.reserve(static_cast<size_t>(h.numel()));
  if (h.numel() == 0) return out;
  const char* base = static_cast<const char*>(h.raw_data());
  const int64_t esize = static_cast<int64_t>(h.element_size());
  std::vector<int64_t> idx(static_cast<size_t>(h.dim()), 0);
  for (int64_t i = 0; i < h.numel(); ++i) {
    int64_t off = 0;
    for (int64_t d = 0; d < h.dim(); ++d) off += idx[static_cast<size_t>(d)] * h.stride(d);
    out.push_back(read_element(base + off * esize, h.dtype()));
    for (int64_t d = h.dim() - 1; d >= 0; --d) {
      if (++idx[static_cast<size_t>(d)] < h.size(d)) break;
      idx[static_cast<size_t>(d)] = 0;
    }
  }
  return out;
}

// |gpu - cpu| <= rtol * |cpu| + atol * max|cpu| for every element (NaN matches NaN).
inline void expect_near(const Tensor& gpu, const Tensor& cpu, double rtol, double atol,
                 const std::string& what) {
  ASSERT_EQ(gpu.sizes(), cpu.sizes()) << what;
  ASSERT_EQ(gpu.dtype(), cpu.dtype()) << what;
  const std::vector<double> got = values(gpu), want = values(cpu);
  double scale = 0.0;
  for (double w : want)
    if (std::isfinite(w)) scale = std::max(scale, std::abs(w));
  int64_t bad = 0;
  size_t first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool both_nan = std::isnan(got[i]) && std::isnan(want[i]);
    const bool ok = both_nan || got[i] == want[i] ||
                    std::abs(got[i] - want[i]) <= rtol * std::abs(want[i]) + atol * scale;
    if (!ok && bad++ == 0) first = i;
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " elements differ; first at "
                    << first << ": gpu " << (got.empty() ? 0 : got[first]) << ", cpu "
                    << (want.empty() ? 0 : want[first]);
}

inline void expect_equal(const Tensor& gpu, const Tensor& cpu, const std::string& what) {
  expect_near(gpu, cpu, 0.0, 0.0, what);
}

inline double tol(DType dtype, double float32_tol) { return dtype == kFloat32 ? float32_tol : 1e-2; }

inline std::string name(DType t) { return dtype_name(t); }

}  // namespace chorus::cuda_twins

#endif  // CHORUS_WITH_CUDA
