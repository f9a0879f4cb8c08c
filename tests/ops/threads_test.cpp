// set_cpu_threads: the CPU ops' thread count changes at any time, OpenBLAS's
// with it, and results do not depend on it.
#include <cblas.h>
#include <gtest/gtest.h>

#include <cmath>

#include <chorus/chorus.h>
#include <chorus/ops/nn.h>

namespace chorus {
namespace {

// Restores the process's thread count: the unit tests share one process.
struct KeepThreads {
  int before = cpu_threads();
  ~KeepThreads() { set_cpu_threads(before); }
};

Tensor conv_then_matmul(const Tensor& x, const Tensor& w, const Tensor& m) {
  ops::Conv2dParams p;
  p.pad_h = p.pad_w = 1;
  return nn::functional::conv2d(x, w, Tensor(), p).reshape({x.size(0), -1}).matmul(m);
}

TEST(CpuThreads, SetChangesOpsAndOpenBlasAndNotTheResults) {
  KeepThreads keep;
  manual_seed(5);
  const Tensor x = randn({8, 3, 16, 16}), w = randn({4, 3, 3, 3}), m = randn({4 * 16 * 16, 5});
  set_cpu_threads(1);
  EXPECT_EQ(cpu_threads(), 1);
  EXPECT_EQ(openblas_get_num_threads(), 1);
  const std::vector<float> one = conv_then_matmul(x, w, m).to_vector<float>();
  set_cpu_threads(3);
  EXPECT_EQ(cpu_threads(), 3);
  EXPECT_EQ(openblas_get_num_threads(), 3);
  const std::vector<float> three = conv_then_matmul(x, w, m).to_vector<float>();
  ASSERT_EQ(one.size(), three.size());
  for (size_t i = 0; i < one.size(); ++i) EXPECT_NEAR(one[i], three[i], 1e-4f * (1.0f + std::abs(one[i]))) << i;
}

TEST(CpuThreads, ZeroThreadsIsAValueError) {
  KeepThreads keep;
  EXPECT_THROW(set_cpu_threads(0), ValueError);
  EXPECT_THROW(set_cpu_threads(-2), ValueError);
  EXPECT_EQ(cpu_threads(), keep.before);
}

}  // namespace
}  // namespace chorus
