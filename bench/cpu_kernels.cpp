// CPU kernel throughput: OpenBLAS sgemm and the im2col convolution on the
// layers that CPU training runs spend their time in. Real (wall) time,
// because OpenBLAS works on its own threads; GFLOP/s counts the multiply-adds
// of the direct convolution (2 * n * c_out * out_hw * c_in/groups * kh * kw
// per pass), so padding zeros and im2col copies are overhead, not work.
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "chorus/cpu/conv2d.h"
#include "chorus/cpu/gemm.h"

namespace {

using chorus::cpu::Conv2dShape;

std::vector<float> random_vector(size_t size, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(size);
  for (float& e : v) e = dist(gen);
  return v;
}

void set_gflops(benchmark::State& state, double flops_per_iteration) {
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops_per_iteration * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_Sgemm(benchmark::State& state) {
  const int64_t m = state.range(0);
  const auto a = random_vector(m * m, 1), b = random_vector(m * m, 2);
  std::vector<float> c(m * m);
  for (auto _ : state) {
    chorus::cpu::gemm(false, false, m, m, m, 1.0f, a.data(), m, b.data(), m, 0.0f, c.data(), m);
    benchmark::DoNotOptimize(c.data());
  }
  set_gflops(state, 2.0 * m * m * m);
}
BENCHMARK(BM_Sgemm)->Arg(512)->Arg(1024)->Unit(benchmark::kMillisecond)->UseRealTime();

// Layers: 0, 1 = the small MNIST CNN's two convolutions (batch 64);
// 2 = a Wide ResNet-16-4 first-stage 3x3 convolution (batch 32, CIFAR-10);
// 3 = a WRN-16-4 stride-2 3x3 convolution into the second stage;
// 4 = a WRN 1x1 shortcut (the pointwise path).
const Conv2dShape kLayers[] = {
    {.n = 64, .c_in = 1, .h = 28, .w = 28, .c_out = 32, .kh = 3, .kw = 3, .pad_h = 1, .pad_w = 1},
    {.n = 64, .c_in = 32, .h = 14, .w = 14, .c_out = 64, .kh = 3, .kw = 3, .pad_h = 1, .pad_w = 1},
    {.n = 32, .c_in = 64, .h = 32, .w = 32, .c_out = 64, .kh = 3, .kw = 3, .pad_h = 1, .pad_w = 1},
    {.n = 32,
     .c_in = 64,
     .h = 32,
     .w = 32,
     .c_out = 128,
     .kh = 3,
     .kw = 3,
     .stride_h = 2,
     .stride_w = 2,
     .pad_h = 1,
     .pad_w = 1},
    {.n = 32, .c_in = 64, .h = 32, .w = 32, .c_out = 128},
};
const char* const kLayerNames[] = {"mnist_conv1_64x1x28x28_32", "mnist_conv2_64x32x14x14_64",
                                   "wrn_3x3_32x64x32x32_64", "wrn_3x3s2_32x64x32x32_128",
                                   "wrn_1x1_32x64x32x32_128"};

enum Pass { kForward = 1, kBackwardInput = 2, kBackwardWeight = 4, kAll = 7 };

void BM_Conv2d(benchmark::State& state) {
  const Conv2dShape& s = kLayers[state.range(0)];
  const int pass = static_cast<int>(state.range(1));
  state.SetLabel(kLayerNames[state.range(0)]);
  const int64_t ohw = s.out_h() * s.out_w();
  const int64_t k_g = s.c_in / s.groups * s.kh * s.kw;
  const auto x = random_vector(s.n * s.c_in * s.h * s.w, 1);
  const auto w = random_vector(s.c_out * k_g, 2);
  const auto bias = random_vector(s.c_out, 3);
  const auto dy = random_vector(s.n * s.c_out * ohw, 4);
  std::vector<float> y(dy.size()), dx(x.size()), dw(w.size()), db(bias.size());
  for (auto _ : state) {
    if (pass & kForward) chorus::cpu::conv2d_forward(s, x.data(), w.data(), bias.data(), y.data());
    if (pass & kBackwardInput)
      chorus::cpu::conv2d_backward_input(s, dy.data(), w.data(), dx.data());
    if (pass & kBackwardWeight)
      chorus::cpu::conv2d_backward_weight(s, dy.data(), x.data(), dw.data(), db.data());
    benchmark::ClobberMemory();
  }
  const int passes = (pass & 1) + ((pass >> 1) & 1) + ((pass >> 2) & 1);
  set_gflops(state, 2.0 * s.n * s.c_out * ohw * k_g * passes);
}
BENCHMARK(BM_Conv2d)
    ->ArgNames({"layer", "pass"})
    ->ArgsProduct({{0, 1, 2, 3, 4}, {kForward, kBackwardInput, kBackwardWeight, kAll}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
