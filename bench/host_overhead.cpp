// The host's cost per op of an eager step (issue 14, item 3): what Chorus
// spends between ops when the kernels themselves take no time. Tensors of one
// element on a CPU device, so each figure is dispatch, allocation, shape and
// stride bookkeeping and (for the autograd rows) graph building and the
// backward engine, per op. On a GPU the same host path runs before every
// kernel launch; an eager step of a small model is bound by it.
//
// Rows (time per op, `ops/s` counter):
//   BM_BinaryNoGrad   ops::binary(Add): dispatch + one output allocation
//   BM_BinaryChannelsLast  the same with channels-last [1,2,2,2] operands
//   BM_AddNoGrad      a + b through the user API, grad mode on, no grad
//   BM_AddAutograd    a + b recording a graph node (a requires grad)
//   BM_ChainBackward  forward and backward of a chain of 32 mul+add pairs,
//                     per op (the backward engine's cost per node)
//   BM_MlpStep        a 3-layer MLP's training step on a batch of 1
//                     (linear, relu, cross-entropy, backward, SGD), per step
// and the heap allocations per op (per step for BM_MlpStep).
//
// Usage: bench_host_overhead [benchmark flags]
#include <benchmark/benchmark.h>

#include <chorus/chorus.h>

#include <atomic>
#include <cstdlib>
#include <new>

#include "chorus/ops/copy.h"
#include "chorus/ops/elementwise.h"

// Every C++ heap allocation counted (the `allocs/op` column): a tensor's
// implementation, its size and stride vectors, its storage, graph nodes.
namespace {
std::atomic<int64_t> g_allocs{0};
}
void* operator new(std::size_t n) {
  g_allocs.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace {

using namespace chorus;

// Sets the allocs/op counter of `state` for `ops` ops per iteration.
struct AllocCount {
  benchmark::State& state;
  double ops;
  int64_t start = g_allocs.load();
  ~AllocCount() {
    state.counters["allocs/op"] = static_cast<double>(g_allocs.load() - start) /
                                  (static_cast<double>(state.iterations()) * ops);
  }
};

void BM_BinaryNoGrad(benchmark::State& state) {
  const Tensor a = randn({1}), b = randn({1});
  AllocCount count{state, 1};
  for (auto _ : state) benchmark::DoNotOptimize(ops::binary(BinaryOp::Add, a, b));
  state.counters["ops/s"] = benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_BinaryNoGrad);

// A channels-last output (what every activation op of a channels-last
// network on a GPU allocates): [1, 2, 2, 2] in NHWC memory.
void BM_BinaryChannelsLast(benchmark::State& state) {
  const Tensor a = ops::to_channels_last(randn({1, 2, 2, 2})), b = ops::to_channels_last(randn({1, 2, 2, 2}));
  AllocCount count{state, 1};
  for (auto _ : state) benchmark::DoNotOptimize(ops::binary(BinaryOp::Add, a, b));
  state.counters["ops/s"] = benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_BinaryChannelsLast);

void BM_AddNoGrad(benchmark::State& state) {
  const Tensor a = randn({1}), b = randn({1});
  AllocCount count{state, 1};
  for (auto _ : state) benchmark::DoNotOptimize(a + b);
  state.counters["ops/s"] = benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_AddNoGrad);

void BM_AddAutograd(benchmark::State& state) {
  Tensor a = randn({1});
  a.requires_grad_();
  const Tensor b = randn({1});
  AllocCount count{state, 1};
  for (auto _ : state) benchmark::DoNotOptimize(a + b);
  state.counters["ops/s"] = benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_AddAutograd);

void BM_ChainBackward(benchmark::State& state) {
  constexpr int kPairs = 32;
  Tensor w = randn({1});
  w.requires_grad_();
  const Tensor x = randn({1});
  AllocCount count{state, 2 * kPairs + 1};
  for (auto _ : state) {
    Tensor y = x;
    for (int i = 0; i < kPairs; ++i) y = y * w + x;
    y.sum().backward();
    w.set_grad(Tensor());
  }
  state.counters["ops/s"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * (2 * kPairs + 1), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_ChainBackward);

void BM_MlpStep(benchmark::State& state) {
  auto model = std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{std::make_shared<nn::Linear>(16, 16), std::make_shared<nn::ReLU>(),
                               std::make_shared<nn::Linear>(16, 16), std::make_shared<nn::ReLU>(),
                               std::make_shared<nn::Linear>(16, 10)});
  optim::SGD opt(model->parameters(), {0.01, 0.9});
  const Tensor x = randn({1, 16});
  const Tensor y = randint(0, 10, {1}, {kInt64, cpu_device(0)});
  AllocCount count{state, 1};
  for (auto _ : state) {
    Tensor loss = nn::functional::cross_entropy(model->forward(x), y);
    opt.zero_grad();
    loss.backward();
    opt.step();
  }
  state.counters["steps/s"] = benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_MlpStep);

}  // namespace

BENCHMARK_MAIN();
