// Note [Memset nodes in a graph] (cuda/runtime/graph_memsets.h): small memset nodes
// become kernel nodes that write the same bytes, in the same place of the
// graph's order; large ones stay.
#ifdef CHORUS_WITH_CUDA

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <chorus/chorus.h>
#include <chorus/cuda/runtime/context.h>
#include <chorus/cuda/runtime/graph_memsets.h>

namespace chorus {
namespace {

size_t count_nodes(cudaGraph_t g, cudaGraphNodeType want) {
  size_t n = 0;
  CHORUS_CUDA_CHECK(cudaGraphGetNodes(g, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  if (n) CHORUS_CUDA_CHECK(cudaGraphGetNodes(g, nodes.data(), &n));
  size_t c = 0;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType t;
    CHORUS_CUDA_CHECK(cudaGraphNodeGetType(node, &t));
    c += t == want;
  }
  return c;
}

cudaGraphNode_t add_memset(cudaGraph_t g, cudaGraphNode_t dep, void* dst, unsigned elem, unsigned value, size_t width,
                           size_t height, size_t pitch) {
  cudaMemsetParams m{};
  m.dst = dst;
  m.elementSize = elem;
  m.value = value;
  m.width = width;
  m.height = height;
  m.pitch = pitch;
  cudaGraphNode_t node;
  CHORUS_CUDA_CHECK(cudaGraphAddMemsetNode(&node, g, &dep, 1, &m));
  return node;
}

// What the memsets do, on the host.
void host_memset(std::vector<uint8_t>& buf, size_t offset, unsigned elem, unsigned value, size_t width, size_t height,
                 size_t pitch) {
  for (size_t r = 0; r < height; ++r)
    for (size_t c = 0; c < width; ++c) std::memcpy(&buf[offset + r * pitch + c * elem], &value, elem);
}

TEST(CudaGraphMemsets, SmallMemsetNodesBecomeKernelsThatWriteTheSameBytesInOrder_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const int dev = cuda_device_count() - 1;  // the last device: the node must run where its memory is
  cuda::CudaDeviceGuard guard(dev);
  constexpr size_t kBytes = 4096, kBig = size_t{3} << 20;
  std::vector<uint8_t> input(kBytes);
  std::mt19937 gen(7);
  for (uint8_t& b : input) b = static_cast<uint8_t>(gen());
  void *buf = nullptr, *big = nullptr;
  CHORUS_CUDA_CHECK(cudaMalloc(&buf, kBytes));
  CHORUS_CUDA_CHECK(cudaMalloc(&big, kBig));
  std::vector<uint8_t> output(kBytes, 0), big_out(kBig, 0);

  cudaGraph_t g;
  CHORUS_CUDA_CHECK(cudaGraphCreate(&g, 0));
  // Random bytes in, then memsets over parts of them, then the bytes out: a
  // rewritten memset must run after the copy in and before the copy out.
  cudaGraphNode_t in, out, out_big;
  CHORUS_CUDA_CHECK(cudaGraphAddMemcpyNode1D(&in, g, nullptr, 0, buf, input.data(), kBytes, cudaMemcpyHostToDevice));
  auto* b = static_cast<uint8_t*>(buf);
  cudaGraphNode_t m4 = add_memset(g, in, b + 16, 4, 0xdeadbeefu, 8, 1, 0);       // cuDNN's kind: 4-byte words
  cudaGraphNode_t m2 = add_memset(g, m4, b + 256, 2, 0x1234u, 10, 3, 64);        // 2-D, after m4
  cudaGraphNode_t m1 = add_memset(g, in, b + 1001, 1, 0x5au, 3, 1, 0);           // unaligned bytes
  cudaGraphNode_t mb = add_memset(g, in, big, 1, 0x77u, kBig, 1, 0);             // too large: stays
  cudaGraphNode_t last[] = {m2, m1};
  CHORUS_CUDA_CHECK(cudaGraphAddMemcpyNode1D(&out, g, last, 2, output.data(), buf, kBytes, cudaMemcpyDeviceToHost));
  CHORUS_CUDA_CHECK(
      cudaGraphAddMemcpyNode1D(&out_big, g, &mb, 1, big_out.data(), big, kBig, cudaMemcpyDeviceToHost));
  ASSERT_EQ(count_nodes(g, cudaGraphNodeTypeMemset), 4u);

  {
    cuda::CudaDeviceGuard other(0);  // the rewrite finds each memset's device itself
    EXPECT_EQ(cuda::rewrite_memset_nodes(g), 3u);
  }
  EXPECT_EQ(count_nodes(g, cudaGraphNodeTypeMemset), 1u);
  EXPECT_EQ(count_nodes(g, cudaGraphNodeTypeKernel), 3u);

  cudaGraphExec_t exec;
  CHORUS_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
  cudaStream_t s;
  CHORUS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int replay = 0; replay < 2; ++replay) {
    std::fill(output.begin(), output.end(), 0);
    CHORUS_CUDA_CHECK(cudaGraphLaunch(exec, s));
    CHORUS_CUDA_CHECK(cudaStreamSynchronize(s));
    std::vector<uint8_t> want = input;
    host_memset(want, 16, 4, 0xdeadbeefu, 8, 1, 0);
    host_memset(want, 256, 2, 0x1234u, 10, 3, 64);
    host_memset(want, 1001, 1, 0x5au, 3, 1, 0);
    EXPECT_EQ(output, want) << "replay " << replay;
    EXPECT_EQ(big_out, std::vector<uint8_t>(kBig, 0x77)) << "replay " << replay;
  }
  CHORUS_CUDA_CHECK(cudaStreamDestroy(s));
  CHORUS_CUDA_CHECK(cudaGraphExecDestroy(exec));
  CHORUS_CUDA_CHECK(cudaGraphDestroy(g));
  CHORUS_CUDA_CHECK(cudaFree(buf));
  CHORUS_CUDA_CHECK(cudaFree(big));
}

// A captured memset (the way cuDNN issues it) is rewritten too.
TEST(CudaGraphMemsets, ACapturedMemsetAsyncIsRewritten_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  cuda::CudaDeviceGuard guard(0);
  void* p = nullptr;
  CHORUS_CUDA_CHECK(cudaMalloc(&p, 64));
  CHORUS_CUDA_CHECK(cudaMemset(p, 0x11, 64));
  cudaStream_t s;
  CHORUS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t g;
  CHORUS_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  CHORUS_CUDA_CHECK(cudaMemsetAsync(static_cast<char*>(p) + 8, 0, 4, s));
  CHORUS_CUDA_CHECK(cudaStreamEndCapture(s, &g));
  EXPECT_EQ(cuda::rewrite_memset_nodes(g), 1u);
  cudaGraphExec_t exec;
  CHORUS_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
  CHORUS_CUDA_CHECK(cudaGraphLaunch(exec, s));
  CHORUS_CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<uint8_t> got(64), want(64, 0x11);
  std::fill(want.begin() + 8, want.begin() + 12, 0);
  CHORUS_CUDA_CHECK(cudaMemcpy(got.data(), p, 64, cudaMemcpyDeviceToHost));
  EXPECT_EQ(got, want);
  CHORUS_CUDA_CHECK(cudaGraphExecDestroy(exec));
  CHORUS_CUDA_CHECK(cudaGraphDestroy(g));
  CHORUS_CUDA_CHECK(cudaStreamDestroy(s));
  CHORUS_CUDA_CHECK(cudaFree(p));
}

}  // namespace
}  // namespace chorus

#endif  // CHORUS_WITH_CUDA
