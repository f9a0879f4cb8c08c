// Batch-norm statistics in the convolution's epilogue (issue 14's "batch norm
// statistics ... fused with the neighbouring convolution through cuDNN's graph
// API runtime fusion"): on WRN-28-10's and WRN-16-4's 3x3 layers, NHWC bf16,
// batch 128, the forward convolution as Chorus runs it, then the convolution
// followed by the training batch norm + ReLU (statistics pass, finalize,
// normalisation), against the best plan cuDNN offers for the convolution with
// a GEN_STATS node (per-channel sum and sum of squares of y) in the same graph
// (cuda::probe_conv_genstats). The fused graph still leaves the finalize and
// the normalisation to run, so it pays when `fused` < `conv` + the statistics
// pass. Also checks the fused sums against a reduction of y.
#include <chorus/chorus.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "chorus/cuda/conv/conv_plan.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/nn.h"
#include "gpu_timing.h"

int main() {
  using namespace chorus;
  if (cuda_device_count() == 0) {
    std::printf("bench_conv_genstats_gpu: no GPU\n");
    return 0;
  }
  const Device dev(DeviceType::CUDA, 0);
  const TensorOptions opts(dev);
  const Tensor busy = randn({4096, 4096}, opts);
  struct L {
    int64_t c, hw;
  };
  std::printf("%-12s %-5s %9s %12s %10s %6s %6s %9s %9s  %s\n", "layer", "dtype", "conv us", "conv+bn us",
              "fused us", "plans", "of", "sum err", "sqsum err", "fused engine");
  for (L l : std::vector<L>{{160, 32}, {320, 16}, {640, 8}, {64, 32}, {128, 16}, {256, 8}}) {
    // bf16 first; fp16 too when no bf16 plan runs (the runtime-fusion
    // engines for these graphs may be fp16 only).
    for (DType dt : {kBFloat16, kFloat16}) {
      const int64_t n = 128;
      const Tensor x = ops::to_channels_last(randn({n, l.c, l.hw, l.hw}, opts).to(dt));
      const Tensor w = ops::to_channels_last((randn({l.c, l.c, 3, 3}, opts) * 0.05).to(dt));
      const Tensor gamma = rand({l.c}, opts).add(0.5), beta = randn({l.c}, opts);
      const Tensor rm = zeros({l.c}, opts), rv = ones({l.c}, opts);
      ops::Conv2dParams p;
      p.pad_h = p.pad_w = 1;
      const double t_conv = bench::time_calls(dev, busy, 50, [&] { (void)ops::conv2d(x, w, Tensor(), p); });
      const double t_conv_bn = bench::time_calls(dev, busy, 50, [&] {
        const Tensor y = ops::conv2d(x, w, Tensor(), p);
        (void)nn::functional::batch_norm_relu(y, rm, rv, gamma, beta, true, 0.1, 1e-5);
      });
      const Tensor y = ops::conv2d(x, w, Tensor(), p);
      const Tensor sum = zeros({l.c}, opts), sqsum = zeros({l.c}, opts);
      const Conv2dGeometry g{n, l.c, l.hw, l.hw, l.c, 3, 3, 1, 1, 1, 1, 1, 1, 1};
      cuda::ConvOperands ops_{x.raw_data(), w.raw_data(), y.raw_data()};
      ops_.sum = static_cast<float*>(sum.raw_data());
      ops_.sqsum = static_cast<float*>(sqsum.raw_data());
      const cuda::GenStatsProbe probe = cuda::probe_conv_genstats(g, dt, cuda::Layout::NHWC, 0, ops_);
      double err = NAN, sq_err = NAN;
      if (probe.plans > 0) {
        // The probe leaves y and the sums of one run of its fastest plan.
        const Tensor yf = y.to(kFloat32);
        const Tensor ref = yf.sum({0, 2, 3}), ref_sq = (yf * yf).sum({0, 2, 3});
        err = (sum - ref).abs().max().item<float>() / std::max(1e-6f, ref.abs().max().item<float>());
        sq_err = (sqsum - ref_sq).abs().max().item<float>() / std::max(1e-6f, ref_sq.abs().max().item<float>());
      }
      char name[32], fused[32];
      std::snprintf(name, sizeof name, "%lldx%lldx%lld", (long long)l.hw, (long long)l.hw, (long long)l.c);
      if (probe.best_ms >= 0) std::snprintf(fused, sizeof fused, "%.1f", 1e3 * probe.best_ms);
      else std::snprintf(fused, sizeof fused, "none");
      const std::string what = probe.error.empty() ? probe.engine : ("refused: " + probe.error).substr(0, 160);
      std::printf("%-12s %-5s %9.1f %12.1f %10s %6d %6d %9.2e %9.2e  %s\n", name, dtype_name(dt), t_conv, t_conv_bn,
                  fused, probe.plans, probe.configs, err, sq_err, what.c_str());
      if (probe.plans > 0) break;
    }
  }
  return 0;
}
