// Note [Attention plan search] (cuda/cudnn/flash_attention.cpp): the fused
// attention's forward and backward with the plan the timed search keeps and
// with cuDNN's first plan, both against the float32 composite path on the
// same bfloat16-rounded inputs (the bound of
// TransformerOps.FusedAttentionMatchesComposite_CUDA: within 1.5x the bf16
// composite's error, or a small floor), and the two plans within bf16
// rounding of each other; which calls search (the first eager call of a
// problem, once; never in heuristic mode).
#ifdef CHORUS_WITH_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>

#include <chorus/chorus.h>
#include <chorus/cuda/kernels/kernels.h>

// A namespace of its own: the unity build batches this file with others.
namespace chorus::attention_search_test {
namespace {

namespace F = nn::functional;

double max_abs_diff(const Tensor& a, const Tensor& b) {
  return (a.to(cpu_device(0), kFloat64) - b.to(cpu_device(0), kFloat64)).abs().max().item();
}

// The search's mode for one test, restored after it.
class SearchMode {
 public:
  explicit SearchMode(bool heuristic) : before_(cuda::heuristic_attention_plans()) {
    cuda::set_heuristic_attention_plans(heuristic);
  }
  ~SearchMode() { cuda::set_heuristic_attention_plans(before_); }

 private:
  bool before_;
};

struct Result {
  Tensor out, grad;
};

// GPT's path: one packed [B, T, 3C] projection, causal, its gradient in place.
Result run(const Tensor& qkv32, const Tensor& go32, int64_t heads, DType dt, ops::AttentionKernel kern) {
  Tensor qkv = qkv32.to(kBFloat16).to(dt).detach().clone().set_requires_grad(true);
  Tensor out = F::causal_self_attention(qkv, heads, 0.0, kern);
  out.backward(go32.to(kBFloat16).to(dt));
  return {out, qkv.grad()};
}

TEST(AttentionSearch, SearchedAndFirstPlansMatchTheComposite_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const Device gpu("cuda:0");
  manual_seed(181);
  // Shapes no other test uses (the plan cache is per process): T not a
  // multiple of 64, head_dim 64 and 128.
  for (int64_t d : {64, 128}) {
    SCOPED_TRACE(::testing::Message() << "head_dim " << d);
    const int64_t b = 3, h = 2, t = 328, c = h * d;
    const Tensor qkv32 = randn({b, t, 3 * c}).to(gpu), go32 = randn({b, t, c}).to(gpu);
    const Result ref = run(qkv32, go32, h, kFloat32, ops::AttentionKernel::Composite);
    const Result comp = run(qkv32, go32, h, kBFloat16, ops::AttentionKernel::Composite);
    const double e_out = max_abs_diff(ref.out, comp.out), e_grad = max_abs_diff(ref.grad, comp.grad);

    Result first, searched;
    {
      SearchMode mode(true);
      const int64_t searches = cuda::attention_searches_run();
      first = run(qkv32, go32, h, kBFloat16, ops::AttentionKernel::Fused);
      EXPECT_EQ(cuda::attention_searches_run(), searches) << "heuristic mode must not time plans";
    }
    {
      SearchMode mode(false);
      const int64_t searches = cuda::attention_searches_run();
      searched = run(qkv32, go32, h, kBFloat16, ops::AttentionKernel::Fused);
      EXPECT_EQ(cuda::attention_searches_run(), searches + 2) << "the forward and the backward are searched";
      const Result again = run(qkv32, go32, h, kBFloat16, ops::AttentionKernel::Fused);
      EXPECT_EQ(cuda::attention_searches_run(), searches + 2) << "a searched problem is not searched again";
      // The forward is deterministic; the backward's dQ may add in any order.
      EXPECT_EQ(max_abs_diff(again.out, searched.out), 0.0) << "the kept plan runs again";
    }
    for (const Result* r : {&first, &searched}) {
      const char* which = r == &first ? "first plan" : "searched plan";
      EXPECT_LT(max_abs_diff(ref.out, r->out), std::max(1.5 * e_out, 2e-3)) << which << ": forward";
      EXPECT_LT(max_abs_diff(ref.grad, r->grad), std::max(1.5 * e_grad, 5e-3)) << which << ": gradient";
    }
    // Two flash kernels over the same bf16 inputs: different tilings round
    // differently, by about one bf16 step of the outputs.
    EXPECT_LT(max_abs_diff(first.out, searched.out), std::max(2 * e_out, 4e-3)) << "first against searched forward";
    EXPECT_LT(max_abs_diff(first.grad, searched.grad), std::max(2 * e_grad, 1e-2))
        << "first against searched gradient";
  }
}

}  // namespace
}  // namespace chorus::attention_search_test

#endif  // CHORUS_WITH_CUDA
