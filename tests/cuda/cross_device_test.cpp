// Cross-device operands between GPUs (Note [Cross-device operands] in
// ops/copy.h), with peer-to-peer access and without it (Note [Peer access
// policy] in cuda/runtime/context.h): every result equals the same computation on one
// GPU, elementwise results bit for bit.
#ifdef CHORUS_WITH_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include <chorus/chorus.h>
#include <chorus/core/persistent_alloc.h>
#include <chorus/cuda/runtime/context.h>

#include "testing/compare.h"

namespace chorus {
namespace {

std::vector<float> host(const Tensor& t) { return t.to(cpu_device(0)).to_vector<float>(); }

using test::rel_err;

struct Grads {
  Tensor loss, w1, w2;
};

// A two-layer model-parallel step: layer 1 on d1, layer 2 on d2 (the
// activation moved there by the caller, as in PyTorch), loss on d2.
Grads two_layer_step(Device d1, Device d2) {
  manual_seed(11);
  Tensor x = randn({64, 48}), w1c = randn({96, 48}), w2c = randn({10, 96});
  Tensor target = randint(0, 10, {64});
  Tensor w1 = w1c.to(d1), w2 = w2c.to(d2);
  w1.set_requires_grad(true);
  w2.set_requires_grad(true);
  Tensor h = nn::functional::linear(x.to(d1), w1, Tensor()).relu();
  Tensor y = nn::functional::linear(h.to(d2), w2, Tensor());
  Tensor loss = nn::functional::cross_entropy(y, target.to(d2));
  loss.backward();
  return {loss, w1.grad(), w2.grad()};
}

void check_cross_device(bool peer) {
  const Device g0 = cuda_device(0), g1 = cuda_device(1);
  cuda::set_peer_access_allowed(peer);
  SCOPED_TRACE(peer ? "with peer access" : "without peer access");
  manual_seed(3);
  Tensor a = randn({257, 129}), b = randn({257, 129}), w = randn({129, 64});

  // One GPU: the reference.
  const Tensor ref_sum = a.to(g0) + b.to(g0);
  const Tensor ref_mm = matmul(a.to(g0), w.to(g0));

  // Operands on two GPUs: the op runs on its first operand's device.
  const Tensor a0 = a.to(g0), b1 = b.to(g1);
  const Tensor s0 = a0 + b1, s1 = b1 + a0;
  EXPECT_EQ(s0.device(), g0);
  EXPECT_EQ(s1.device(), g1);
  EXPECT_EQ(host(s0), host(ref_sum));
  EXPECT_EQ(host(s1), host(ref_sum));
  const Tensor mm = matmul(a.to(g1), w.to(g0));
  EXPECT_EQ(mm.device(), g1);
  EXPECT_LE(rel_err(mm, ref_mm), 1e-6);

  // Large copies both ways, each right after work that writes the source.
  Tensor big = randn({1 << 22}).to(g0);
  Tensor there = (big * 2.0).to(g1);
  Tensor back = (there + 1.0).to(g0);
  EXPECT_EQ(host(back), host(big * 2.0 + 1.0));

  // Model parallelism: gradients cross devices in backward.
  const Grads one = two_layer_step(g0, g0), two = two_layer_step(g0, g1);
  EXPECT_EQ(two.w1.device(), g0);
  EXPECT_EQ(two.w2.device(), g1);
  EXPECT_LE(rel_err(two.loss, one.loss), 1e-6);
  EXPECT_LE(rel_err(two.w1, one.w1), 1e-5);
  EXPECT_LE(rel_err(two.w2, one.w2), 1e-5);
}

TEST(CudaCrossDevice, ResultsEqualOneGpuWithPeerAccess_MultiCUDA) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs 2 CUDA devices";
  check_cross_device(true);
  int can = 0;
  cudaDeviceCanAccessPeer(&can, 0, 1);
  EXPECT_EQ(cuda::peer_access_enabled(0, 1), can != 0);
}

TEST(CudaCrossDevice, ResultsEqualOneGpuWithoutPeerAccess_MultiCUDA) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs 2 CUDA devices";
  check_cross_device(false);
  EXPECT_FALSE(cuda::peer_access_enabled(0, 1));
  EXPECT_FALSE(cuda::peer_access_enabled(1, 0));
  cuda::set_peer_access_allowed(true);
}

// Note [Persistent allocations]: tensors from the persistent pool (the
// optimizer's state, autocast's kept copies) are reached from the other GPU
// as the default pool's are -- the pool made before peer access is enabled,
// and granted when it is.
TEST(CudaCrossDevice, PeersReachThePersistentPool_MultiCUDA) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs 2 CUDA devices";
  const Device g0 = cuda_device(0), g1 = cuda_device(1);
  cuda::set_peer_access_allowed(false);
  manual_seed(5);
  Tensor a = randn({513, 67}), b = randn({513, 67});
  Tensor a0, b1;
  {
    PersistentAllocations persistent;
    a0 = a.to(g0);
    b1 = b.to(g1);
  }
  cuda::set_peer_access_allowed(true);
  const Tensor s1 = b1 + a0, s0 = a0 + b1;
  EXPECT_EQ(s1.device(), g1);
  EXPECT_EQ(host(s1), host(a + b));
  EXPECT_EQ(host(s0), host(a + b));
  const Tensor far = (a0 * 3.0).to(g1);
  EXPECT_EQ(host(far), host(a * 3.0));
}

}  // namespace
}  // namespace chorus

#endif  // CHORUS_WITH_CUDA
