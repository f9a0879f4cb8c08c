// Random fills of the CUDA kernel set, drawn from Philox (core/philox.h) so
// that the CPU kernels produce the same numbers for the same RngState.
//
// Note [Random formulas]: the CPU kernels must compute exactly this. With
// u(k) = philox::uniform(seed, offset, k) and w(k) = philox::word(seed, offset, k):
//   uniform  v_i = float(lo) + float(hi - lo) * u(i)
//            (float math, two roundings: no fused multiply-add; hi - lo in double)
//   normal   u1 = double(u(2i)), u2 = double(u(2i + 1))
//            z  = sqrt(-2.0 * log(1.0 - u1)) * cos(2.0 * M_PI * u2)     (double)
//            v_i = float(mean + std * z)                                (double, no fma)
//            so a normal fill of n elements uses 2n words.
//   randint  v_i = lo + int64(uint64(w(i)) % uint64(hi - lo))
//   dropout  v_i = u(i) >= float(p) ? float(1.0 / (1.0 - p)) : 0.0f
// and the value is then converted to the output dtype (16-bit floats: round to
// nearest even from the float). Double precision for the normal's log and cos
// makes the libm differences between host and device vanish in the float.
//
// One thread computes one Philox block (4 words): 4 elements of a uniform,
// randint or dropout fill, 2 of a normal.
#include <cstdint>

#include "chorus/core/graph_capture.h"
#include "chorus/core/philox.h"
#include "chorus/cuda/runtime/context.h"
#include "chorus/cuda/kernels/dtype_dispatch.cuh"
#include "chorus/cuda/kernels/kernels.h"
#include "chorus/cuda/kernels/tensor_iter.cuh"

namespace chorus::cuda {

namespace {

constexpr double kTwoPi = 6.283185307179586476925286766559;  // 2.0 * M_PI, exactly as a double

__device__ __forceinline__ uint32_t lane(const philox::U4& r, int j) {
  return j == 0 ? r.x : j == 1 ? r.y : j == 2 ? r.z : r.w;
}

template <typename T>
struct UniformGen {
  static constexpr int kPerBlock = 4;
  float lo, range;
  __device__ T operator()(const philox::U4& r, int j) const {
    // __fmul_rn/__fadd_rn keep the compiler from fusing into an fma.
    return convert<T>(__fadd_rn(lo, __fmul_rn(range, philox::to_unit(lane(r, j)))));
  }
};

template <typename T>
struct NormalGen {
  static constexpr int kPerBlock = 2;
  double mean, std;
  __device__ T operator()(const philox::U4& r, int j) const {
    const double u1 = philox::to_unit(lane(r, 2 * j));
    const double u2 = philox::to_unit(lane(r, 2 * j + 1));
    const double z = __dmul_rn(sqrt(__dmul_rn(-2.0, log(1.0 - u1))), cos(__dmul_rn(kTwoPi, u2)));
    return convert<T>(static_cast<float>(__dadd_rn(mean, __dmul_rn(std, z))));
  }
};

template <typename T>
struct RandintGen {
  static constexpr int kPerBlock = 4;
  int64_t lo;
  uint64_t range;
  __device__ T operator()(const philox::U4& r, int j) const {
    return convert<T>(lo + static_cast<int64_t>(static_cast<uint64_t>(lane(r, j)) % range));
  }
};

template <typename T>
struct DropoutGen {
  static constexpr int kPerBlock = 4;
  float p, scale;
  __device__ T operator()(const philox::U4& r, int j) const {
    return convert<T>(philox::to_unit(lane(r, j)) >= p ? scale : 0.0f);
  }
};

template <typename T, typename Gen>
__global__ void random_kernel(T* out, int64_t n, uint64_t seed, uint64_t offset, Gen gen) {
  constexpr int K = Gen::kPerBlock;
  const int64_t blocks = (n + K - 1) / K;
  for (int64_t b = global_thread_id(); b < blocks; b += grid_stride()) {
    const philox::U4 r = philox::philox4x32(seed, offset + static_cast<uint64_t>(b), 0);
#pragma unroll
    for (int j = 0; j < K; ++j) {
      const int64_t i = b * K + j;
      if (i < n) out[i] = gen(r, j);
    }
  }
}

template <typename T, typename Gen>
void launch_random(const Tensor& out, RngState rng, const Gen& gen, const char* op) {
  CHORUS_CHECK(out.device().is_cuda(), op, ": expected a CUDA tensor, got ", out.describe());
  CHORUS_CHECK(out.is_contiguous(), op, ": the output must be contiguous, got ", out.describe());
  const int64_t n = out.numel();
  if (n == 0) return;
  const int dev = out.device().index;
  // The counter offset is a kernel argument: a replay would draw the same numbers.
  if (is_capturing(current_stream(dev))) check_not_capturing("drawing random numbers (dropout)");
  CudaDeviceGuard guard(dev);
  const int64_t blocks = (n + Gen::kPerBlock - 1) / Gen::kPerBlock;
  random_kernel<T, Gen><<<grid_for(blocks), kThreads, 0, current_stream(dev)>>>(
      static_cast<T*>(out.raw_data()), n, rng.seed, rng.offset, gen);
  CHORUS_CUDA_LAUNCH_CHECK();
}

}  // namespace

void uniform(const Tensor& out, double lo, double hi, RngState rng) {
  CHORUS_CHECK(lo <= hi, "uniform: need lo <= hi, got lo=", lo, " hi=", hi);
  dispatch_float(out.dtype(), "uniform", [&]<typename T>() {
    launch_random<T>(out, rng,
                     UniformGen<T>{static_cast<float>(lo), static_cast<float>(hi - lo)}, "uniform");
  });
}

void normal(const Tensor& out, double mean, double std, RngState rng) {
  CHORUS_CHECK(std >= 0.0, "normal: std must be >= 0, got ", std);
  dispatch_float(out.dtype(), "normal", [&]<typename T>() {
    launch_random<T>(out, rng, NormalGen<T>{mean, std}, "normal");
  });
}

void randint(const Tensor& out, int64_t lo, int64_t hi, RngState rng) {
  CHORUS_CHECK(hi > lo, "randint: empty range [", lo, ", ", hi, ")");
  dispatch_numeric(out.dtype(), "randint", [&]<typename T>() {
    launch_random<T>(out, rng,
                     RandintGen<T>{lo, static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo)},
                     "randint");
  });
}

void dropout_mask(const Tensor& out, double p, RngState rng) {
  CHORUS_CHECK(p >= 0.0 && p <= 1.0, "dropout: p must be in [0, 1], got ", p);
  // p == 1: no u(i) reaches 1, so every element is 0 and the infinite scale is never used.
  const float scale = p < 1.0 ? static_cast<float>(1.0 / (1.0 - p)) : 0.0f;
  dispatch_float(out.dtype(), "dropout", [&]<typename T>() {
    launch_random<T>(out, rng, DropoutGen<T>{static_cast<float>(p), scale}, "dropout");
  });
}

}  // namespace chorus::cuda
