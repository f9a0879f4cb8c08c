// GPU batch norm + ReLU kernels alone (issue 14): microseconds per training
// forward and backward of one channels-last layer and the bandwidth that
// makes, on the layer shapes of WRN-28-10 and WRN-16-4 (batch 128, CIFAR).
//
// Bytes counted are the least each pass must move: the forward reads x for
// the statistics, then reads x and writes y; the backward reads dy and x for
// the column sums, then reads both again and writes dx. So GB/s near the
// GPU's copy bandwidth means the kernels are memory-bound as they should be.
//
// The timed calls are queued behind ~20 ms of matrix products, so the events
// time the GPU, not the host's launch rate.
//
// Usage: bench_batch_norm_gpu [--fp32] [--iters N] [--channels C] (one layer
// width only: for a profiler)
#include <chorus/chorus.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "chorus/core/stream.h"
#include "gpu_timing.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/nn.h"

namespace {

using namespace chorus;

struct Layer {
  const char* model;
  int64_t c, hw;
};

using bench::time_calls;

}  // namespace

int main(int argc, char** argv) {
  DType dt = kBFloat16;
  int iters = 50;
  int64_t only_c = 0;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--fp32")) {
      dt = kFloat32;
    } else if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) {
      iters = std::stoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--channels") && i + 1 < argc) {
      only_c = std::stoll(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: bench_batch_norm_gpu [--fp32] [--iters N] [--channels C]\n");
      return 2;
    }
  }
  if (cuda_device_count() == 0) {
    std::printf("bench_batch_norm_gpu: no GPU, nothing to time\n");
    return 0;
  }
  const Device dev(DeviceType::CUDA, 0);
  const std::vector<Layer> layers = {{"wrn-28-10", 16, 32},  {"wrn-28-10", 160, 32}, {"wrn-28-10", 320, 16},
                                     {"wrn-28-10", 640, 8},  {"wrn-16-4", 64, 32},   {"wrn-16-4", 128, 16},
                                     {"wrn-16-4", 256, 8}};
  const int64_t n = 128;
  const Tensor busy = randn({4096, 4096}, TensorOptions(dev));
  std::printf("%-10s %-16s %9s %9s %9s %9s\n", "model", "layer (NHWC)", "fwd us", "fwd GB/s", "bwd us", "bwd GB/s");
  for (const Layer& l : layers) {
    if (only_c != 0 && l.c != only_c) continue;
    const TensorOptions opts = TensorOptions(dev);
    const Tensor x = ops::to_channels_last(randn({n, l.c, l.hw, l.hw}, opts).to(dt));
    const Tensor dy = ops::to_channels_last(randn({n, l.c, l.hw, l.hw}, opts).to(dt));
    const Tensor gamma = rand({l.c}, opts), beta = randn({l.c}, opts);
    const Tensor rm = randn({l.c}, opts), rv = rand({l.c}, opts);
    const auto out = ops::batch_norm_relu(x, gamma, beta, rm, rv, 0.1, 1e-5);
    const Tensor& y = std::get<0>(out);
    const Tensor& mean = std::get<1>(out);
    const Tensor& invstd = std::get<2>(out);
    const double bytes = static_cast<double>(x.numel()) * static_cast<double>(dtype_size(dt));
    const double fwd =
        time_calls(dev, busy, iters, [&] { (void)ops::batch_norm_relu(x, gamma, beta, rm, rv, 0.1, 1e-5); });
    const double bwd = time_calls(
        dev, busy, iters, [&] { (void)ops::batch_norm_relu_backward(dy, y, x, gamma, beta, mean, invstd); });
    const std::string shape = std::to_string(l.hw) + "x" + std::to_string(l.hw) + "x" + std::to_string(l.c);
    std::printf("%-10s %-16s %9.1f %9.0f %9.1f %9.0f\n", l.model, shape.c_str(), fwd, 3 * bytes / fwd * 1e-3, bwd,
                5 * bytes / bwd * 1e-3);
  }
  return 0;
}
