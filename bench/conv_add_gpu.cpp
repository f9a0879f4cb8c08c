// A forward convolution with the residual add in cuDNN's epilogue
// (ops::conv2d_add; Note [Residual add in the epilogue] in cuda/conv/conv.cpp)
// against the convolution and a separate add, on the 3x3 layer shapes of
// WRN-28-10 and WRN-16-4, NHWC bf16, batch 128: microseconds per call
// (queued behind matrix products, so the events time the GPU) and the largest
// difference from conv + add. CHORUS_CONV_ADD_EPILOGUE=0 times the fallback.
#include <chorus/chorus.h>

#include <cstdio>
#include <vector>

#include "chorus/core/stream.h"
#include "gpu_timing.h"
#include "chorus/cuda/conv/conv_plan.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/nn.h"

namespace {

using namespace chorus;

using bench::time_calls;

}  // namespace

int main() {
  if (cuda_device_count() == 0) {
    std::printf("bench_conv_add_gpu: no GPU\n");
    return 0;
  }
  const Device dev(DeviceType::CUDA, 0);
  const TensorOptions opts(dev);
  const Tensor busy = randn({4096, 4096}, opts);
  struct L { int64_t c, hw; };
  std::printf("%-14s %10s %10s %10s %10s %10s\n", "layer", "conv us", "add us", "sum", "conv_add us", "max diff");
  for (L l : std::vector<L>{{160, 32}, {320, 16}, {640, 8}, {64, 32}, {128, 16}, {256, 8}}) {
    const int64_t n = 128;
    const Tensor x = ops::to_channels_last(randn({n, l.c, l.hw, l.hw}, opts).to(kBFloat16));
    const Tensor w = ops::to_channels_last((randn({l.c, l.c, 3, 3}, opts) * 0.05).to(kBFloat16));
    const Tensor r = ops::to_channels_last(randn({n, l.c, l.hw, l.hw}, opts).to(kBFloat16));
    ops::Conv2dParams p;
    p.pad_h = p.pad_w = 1;
    const double t_conv = time_calls(dev, busy, 50, [&] { (void)ops::conv2d(x, w, Tensor(), p); });
    const Tensor y0 = ops::conv2d(x, w, Tensor(), p);
    const double t_add = time_calls(dev, busy, 50, [&] { (void)(y0 + r); });
    const Tensor ref = y0 + r;
    const int64_t before = cuda::conv_add_epilogue_runs();
    const Tensor y = ops::conv2d_add(x, w, r, p);
    const bool ok = cuda::conv_add_epilogue_runs() > before;
    const double t_fused = time_calls(dev, busy, 50, [&] { (void)ops::conv2d_add(x, w, r, p); });
    const double diff = (y.to(kFloat32) - ref.to(kFloat32)).abs().max().item();
    std::printf("%3lldx%-3lldx%-6lld %10.1f %10.1f %10.1f %10.1f %10.4f%s\n", (long long)l.hw, (long long)l.hw,
                (long long)l.c, t_conv, t_add, t_conv + t_add, t_fused, diff, ok ? "" : " (not fused: conv + add)");
  }
  return 0;
}
