// The residual add in the convolution's epilogue on a GPU (Note [Residual add
// in the epilogue] in cuda/conv/conv.cpp) against the CPU's convolution followed by
// an add: layer shapes of the Wide ResNets, NHWC and NCHW, float32 (TF32 off)
// and bfloat16, and a whole Wide ResNet's loss and gradients on the GPU
// against the same weights on the CPU.
#ifdef CHORUS_WITH_CUDA

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <chorus/autograd/autocast.h>
#include <chorus/chorus.h>
#include <chorus/cuda/blas/blas.h>
#include <chorus/cuda/conv/conv_plan.h>
#include <chorus/models/models.h>
#include <chorus/ops/copy.h>

#include "testing/compare.h"

namespace chorus {
namespace {

namespace F = nn::functional;

class Fp32Exact {  // TF32 off for the scope, switches restored
 public:
  Fp32Exact() : matmul_(cuda::allow_tf32_matmul()), conv_(cuda::allow_tf32_conv()) { cuda::set_allow_tf32(false); }
  ~Fp32Exact() {
    cuda::set_allow_tf32_matmul(matmul_);
    cuda::set_allow_tf32_conv(conv_);
  }

 private:
  bool matmul_, conv_;
};

struct Case {
  int64_t n, c, k, hw, kernel, stride;
};

TEST(ConvAddCuda, MatchesCpuConvThenAdd_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  Fp32Exact exact;
  const Device gpu = cuda_device(0);
  const std::vector<Case> cases = {{8, 64, 64, 16, 3, 1}, {4, 160, 160, 8, 3, 1}, {6, 32, 48, 9, 3, 2},
                                   {5, 24, 40, 8, 1, 2}};
  const bool heuristic = cuda::heuristic_plans();
  struct Restore {
    bool prev;
    ~Restore() {
      cuda::set_heuristic_plans(prev);
      cuda::set_conv_add_epilogue(true);
    }
  } restore{heuristic};
  // Untimed (heuristic plans), a geometry with a fused plan always takes it;
  // timed, each takes the faster of the fused plan and conv + add; with the
  // epilogue off, every one runs the convolution then the add (flat views).
  enum Mode { kUntimed, kTimed, kSplit };
  for (Mode mode : {kUntimed, kTimed, kSplit})
  for (const Case& c : cases)
    for (DType dt : {kFloat32, kBFloat16})
      for (bool cl : {true, false}) {
        const bool untimed = mode == kUntimed;
        cuda::set_heuristic_plans(untimed);
        cuda::set_conv_add_epilogue(mode != kSplit);
        const int64_t fused_before = cuda::conv_add_epilogue_runs();
        manual_seed(static_cast<uint64_t>(c.c * 7 + c.stride));
        const F::Conv2dParams p{c.stride, c.stride, c.kernel / 2, c.kernel / 2, 1, 1, 1};
        // Values exact in the dtype, so both sides see the same inputs.
        const Tensor x = randn({c.n, c.c, c.hw, c.hw}).to(dt).to(kFloat32);
        const Tensor w = randn({c.k, c.c, c.kernel, c.kernel}).mul(0.1).to(dt).to(kFloat32);
        const Tensor ref_y = F::conv2d(x, w, Tensor(), p);
        const Tensor r = randn(ref_y.sizes()).to(dt).to(kFloat32);
        const Tensor ref = add(ref_y, r);
        Tensor gx = x.to(gpu).to(dt), gw = w.to(gpu).to(dt), gr = r.to(gpu).to(dt);
        if (cl) {
          gx = ops::to_channels_last(gx);
          gw = ops::to_channels_last(gw);
          gr = ops::to_channels_last(gr);
        }
        const Tensor y = F::conv2d_add(gx, gw, Tensor(), gr, p);
        const std::string what = std::to_string(c.hw) + "x" + std::to_string(c.hw) + "x" + std::to_string(c.c) + " -> " +
                                 std::to_string(c.k) + " k" + std::to_string(c.kernel) + " s" +
                                 std::to_string(c.stride) + " " + dtype_name(dt) + (cl ? " NHWC" : " NCHW");
        EXPECT_EQ(ops::is_channels_last(y), cl) << what;
        // bf16: one rounding of the output (2^-8 relative); float32: accumulation order.
        const char* mode_name = mode == kUntimed ? " untimed" : mode == kTimed ? " timed" : " split";
        EXPECT_LT(test::rel_err(y, ref), dt == kBFloat16 ? 1e-2 : 1e-5) << what << mode_name;
        if (mode == kSplit) EXPECT_EQ(cuda::conv_add_epilogue_runs(), fused_before) << what << ": fused while off";
        // The NHWC bf16 3x3 convolutions have a fused plan on every GPU cuDNN
        // 9 supports; without one this test would only check the fallback.
        if (untimed && cl && dt == kBFloat16 && c.kernel == 3)
          EXPECT_GT(cuda::conv_add_epilogue_runs(), fused_before) << what << ": not fused";
      }
}

TEST(ConvAddCuda, AutocastKeepsAWiderResidual_CUDA) {
  // Under bf16 autocast a float32 residual is not narrowed: the convolution
  // runs in bf16 and the add promotes, as conv2d followed by add would.
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const Device gpu = cuda_device(0);
  manual_seed(12);
  const Tensor x = ops::to_channels_last(randn({4, 16, 8, 8}).to(gpu));
  const Tensor w = randn({16, 16, 3, 3}).mul(0.1).to(gpu);
  const Tensor r = ops::to_channels_last(randn({4, 16, 8, 8}).to(gpu));
  const F::Conv2dParams p{1, 1, 1, 1, 1, 1, 1};
  AutocastGuard amp(kBFloat16);
  const Tensor y = F::conv2d_add(x, w, Tensor(), r, p);
  const Tensor ref = add(F::conv2d(x, w, Tensor(), p), r);
  EXPECT_EQ(y.dtype(), kFloat32);
  EXPECT_EQ(ref.dtype(), kFloat32);
  EXPECT_EQ(test::rel_err(y, ref), 0.0);
  // A bf16 residual is fused and the output is bf16.
  EXPECT_EQ(F::conv2d_add(x, w, Tensor(), r.to(kBFloat16), p).dtype(), kBFloat16);
}

TEST(ConvAddCuda, WideResNetMatchesCpu_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  Fp32Exact exact;
  const Device gpu = cuda_device(0);
  manual_seed(31);
  nn::ModulePtr cpu_model = models::make_model("wrn-10-2", models::ModelSpec{{3, 16, 16}, 10});
  nn::ModulePtr gpu_model = models::make_model("wrn-10-2", models::ModelSpec{{3, 16, 16}, 10});
  gpu_model->load_state_dict(cpu_model->state_dict());
  gpu_model->to(gpu);
  gpu_model->to_channels_last();
  const Tensor x = randn({6, 3, 16, 16});
  const Tensor target = randint(0, 10, {6});
  Tensor cpu_loss = F::cross_entropy(cpu_model->forward(x), target);
  cpu_loss.backward();
  Tensor gpu_loss = F::cross_entropy(gpu_model->forward(ops::to_channels_last(x.to(gpu))), target.to(gpu));
  gpu_loss.backward();
  EXPECT_LT(test::rel_err(gpu_loss, cpu_loss), 1e-5);
  const auto pc = cpu_model->named_parameters(), pg = gpu_model->named_parameters();
  ASSERT_EQ(pc.size(), pg.size());
  for (size_t i = 0; i < pc.size(); ++i) EXPECT_LT(test::rel_err(pg[i].second.grad(), pc[i].second.grad()), 1e-3) << pc[i].first;
}

}  // namespace
}  // namespace chorus

#endif  // CHORUS_WITH_CUDA
