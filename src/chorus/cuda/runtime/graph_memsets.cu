// Note [Memset nodes in a graph] (graph_memsets.h).
#include "chorus/cuda/runtime/graph_memsets.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "chorus/core/env_switches.h"
#include "chorus/cuda/runtime/context.h"

namespace chorus::cuda {

namespace {

// Writes `value` (1, 2 or 4 bytes wide) to `height` rows of `width` elements,
// `pitch` bytes apart: what the memset node did.
__global__ void fill_kernel(char* dst, size_t pitch, unsigned value, unsigned elem, size_t width, size_t height) {
  const size_t n = width * height;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    char* p = dst + (i / width) * pitch + (i % width) * elem;
    if (elem == 4)
      *reinterpret_cast<uint32_t*>(p) = value;
    else if (elem == 2)
      *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(value);
    else
      *reinterpret_cast<uint8_t*>(p) = static_cast<uint8_t>(value);
  }
}

bool plain_edges(const std::vector<cudaGraphEdgeData>& edges) {
  for (const cudaGraphEdgeData& e : edges)
    if (e.from_port != 0 || e.to_port != 0 || e.type != cudaGraphDependencyTypeDefault) return false;
  return true;
}

// The node's dependencies (or dependants) and their edges.
void neighbours(cudaGraphNode_t node, bool before, std::vector<cudaGraphNode_t>& nodes,
                std::vector<cudaGraphEdgeData>& edges) {
  size_t n = 0;
  if (before)
    CHORUS_CUDA_CHECK(cudaGraphNodeGetDependencies(node, nullptr, nullptr, &n));
  else
    CHORUS_CUDA_CHECK(cudaGraphNodeGetDependentNodes(node, nullptr, nullptr, &n));
  nodes.assign(n, nullptr);
  edges.assign(n, cudaGraphEdgeData{});
  if (n == 0) return;
  if (before)
    CHORUS_CUDA_CHECK(cudaGraphNodeGetDependencies(node, nodes.data(), edges.data(), &n));
  else
    CHORUS_CUDA_CHECK(cudaGraphNodeGetDependentNodes(node, nodes.data(), edges.data(), &n));
}

// The device that owns `p`, or -1 where it is not device memory.
int owner_of(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return a.type == cudaMemoryTypeDevice ? a.device : -1;
}

}  // namespace

bool rewrite_graph_memsets() {
  const char* v = chorus::env::get("CHORUS_GRAPH_MEMSETS");
  return !(v && std::strcmp(v, "keep") == 0);
}

size_t rewrite_memset_nodes(cudaGraph_t graph) {
  size_t count = 0;
  CHORUS_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &count));
  std::vector<cudaGraphNode_t> nodes(count);
  if (count) CHORUS_CUDA_CHECK(cudaGraphGetNodes(graph, nodes.data(), &count));
  size_t rewritten = 0;
  std::vector<cudaGraphNode_t> deps, outs;
  std::vector<cudaGraphEdgeData> dep_edges, out_edges;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type;
    CHORUS_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
    if (type != cudaGraphNodeTypeMemset) continue;
    cudaMemsetParams m{};
    CHORUS_CUDA_CHECK(cudaGraphMemsetNodeGetParams(node, &m));
    const size_t elements = m.width * m.height;
    if (elements * m.elementSize > kMaxRewrittenMemsetBytes || elements == 0) continue;
    const int device = owner_of(m.dst);
    if (device < 0) continue;
    neighbours(node, true, deps, dep_edges);
    neighbours(node, false, outs, out_edges);
    if (!plain_edges(dep_edges) || !plain_edges(out_edges)) continue;

    CudaDeviceGuard guard(device);  // a kernel node runs on the device current at its creation
    char* dst = static_cast<char*>(m.dst);
    size_t pitch = m.height > 1 ? m.pitch : 0;
    unsigned value = m.value, elem = m.elementSize;
    size_t width = m.width, height = m.height;
    void* args[] = {&dst, &pitch, &value, &elem, &width, &height};
    cudaKernelNodeParams k{};
    k.func = reinterpret_cast<void*>(fill_kernel);
    const size_t threads = 256;
    k.blockDim = dim3(threads);
    k.gridDim = dim3(static_cast<unsigned>(std::min<size_t>((elements + threads - 1) / threads, 1024)));
    k.kernelParams = args;
    cudaFuncAttributes attr;
    CHORUS_CUDA_CHECK(cudaFuncGetAttributes(&attr, fill_kernel));  // loads the module on this device
    cudaGraphNode_t fill = nullptr;
    CHORUS_CUDA_CHECK(cudaGraphAddKernelNode(&fill, graph, deps.data(), deps.size(), &k));
    for (cudaGraphNode_t out : outs) CHORUS_CUDA_CHECK(cudaGraphAddDependencies(graph, &fill, &out, nullptr, 1));
    CHORUS_CUDA_CHECK(cudaGraphDestroyNode(node));  // and its edges
    ++rewritten;
  }
  return rewritten;
}

}  // namespace chorus::cuda
