// copy_multi of the CUDA kernel set: many flat same-device copies in one
// launch (DataParallel packs ~200 parameters and ~100 gradients a step; one
// cudaMemcpyAsync or kernel each costs more host time than the GPU spends).
//
// Note [Multi-tensor copy]: as sgd_update_multi (optim.cu), the table of
// (source, destination, bytes) and the block -> (pair, chunk) map travel as the
// kernel argument, under CUDA's 4 KiB parameter limit; a longer list, or more
// chunks than one launch has blocks, takes several launches (a pair may span
// two). Each block copies one chunk of one pair: in 16-byte vectors when both
// pointers are 16-byte aligned, in 4-byte words when they are 4-byte aligned,
// else byte by byte; what is left past the last whole vector, byte by byte.
// Chunks start at multiples of the chunk size (a power of two), so a chunk of
// an aligned pair is aligned too. The chunk size follows the call's bytes:
// 256 KiB for large copies, down to 16 KiB (one pass of a block's loads) so
// that a small copy still spreads over the SMs. A graphed step's inputs (a
// CIFAR batch of 128, 1.5 MB) took 6 blocks of 256 KiB, and several times as
// long as with smaller chunks, every step before its first kernel (CUPTI trace
// of DataParallel WRN-16-4 on an H100; benchmarks journal, session 29).
#include <cstdint>

#include "chorus/core/error.h"
#include "chorus/cuda/runtime/context.h"
#include "chorus/cuda/kernels/kernels.h"
#include "chorus/cuda/kernels/tensor_iter.cuh"

namespace chorus::cuda {

namespace {

constexpr int kCopyPairs = 64;
constexpr int kCopyBlocks = 440;
constexpr int64_t kMaxChunkBytes = int64_t{1} << 18;  // 256 KiB per block
constexpr int kUnroll = 4;                            // loads in flight per thread
constexpr int64_t kMinChunkBytes = int64_t{16} * kThreads * kUnroll;  // 16 KiB
// About two blocks per SM of an H100 for copies up to 132 MiB.
constexpr int64_t kTargetBlocks = 264;

// The chunk size for a call copying `total` bytes (Note [Multi-tensor copy]).
int64_t chunk_bytes_for(int64_t total) {
  int64_t chunk = kMinChunkBytes;
  while (chunk < kMaxChunkBytes && chunk * kTargetBlocks < total) chunk *= 2;
  return chunk;
}

struct CopyTable {
  const char* src[kCopyPairs];
  char* dst[kCopyPairs];
  int64_t bytes[kCopyPairs];
  int64_t chunk_bytes;
  uint8_t pair[kCopyBlocks];
  int32_t chunk[kCopyBlocks];
};
static_assert(sizeof(CopyTable) < 4000, "kernel parameters too large");
static_assert(kCopyPairs <= 256, "pair indices are uint8_t");

// Copies the n units of V at src and dst (both aligned to V): kUnroll loads
// issued before their stores, so each thread keeps several in flight.
template <typename V>
__device__ __forceinline__ void copy_units(const V* __restrict__ src, V* __restrict__ dst, int64_t n) {
  const int64_t step = int64_t{blockDim.x} * kUnroll;
  for (int64_t base = threadIdx.x; base < n; base += step) {
    V r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + int64_t{u} * blockDim.x;
      if (i < n) r[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + int64_t{u} * blockDim.x;
      if (i < n) dst[i] = r[u];
    }
  }
}

__global__ void copy_multi_kernel(CopyTable t) {
  const int k = t.pair[blockIdx.x];
  const int64_t begin = int64_t{t.chunk[blockIdx.x]} * t.chunk_bytes;
  const int64_t end = min(t.bytes[k], begin + t.chunk_bytes);
  const char* src = t.src[k] + begin;
  char* dst = t.dst[k] + begin;
  const int64_t len = end - begin;
  const uintptr_t align = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst);
  int64_t done = 0;
  if ((align & 15) == 0) {
    done = len / 16 * 16;
    copy_units(reinterpret_cast<const uint4*>(src), reinterpret_cast<uint4*>(dst), len / 16);
  } else if ((align & 3) == 0) {
    done = len / 4 * 4;
    copy_units(reinterpret_cast<const uint32_t*>(src), reinterpret_cast<uint32_t*>(dst), len / 4);
  }
  for (int64_t i = done + threadIdx.x; i < len; i += blockDim.x) dst[i] = src[i];
}

}  // namespace

void copy_multi(const TensorList& srcs, const TensorList& dsts) {
  CHORUS_CHECK(srcs.size() == dsts.size(), "copy_multi: ", srcs.size(), " sources but ", dsts.size(),
               " destinations");
  if (srcs.empty()) return;
  const Device dev = dsts[0].device();
  CHORUS_CHECK(dev.is_cuda(), "copy_multi: expected CUDA tensors, got ", dsts[0].describe());
  for (size_t i = 0; i < srcs.size(); ++i) {
    const Tensor& s = srcs[i];
    const Tensor& d = dsts[i];
    CHORUS_CHECK(s.dtype() == d.dtype() && s.numel() == d.numel() && s.is_contiguous() &&
                     d.is_contiguous() && s.device() == dev && d.device() == dev,
                 "copy_multi: pair ", i, " needs contiguous tensors of one dtype and size on ",
                 dev.str(), ", got ", s.describe(), " -> ", d.describe());
  }
  const int index = dev.index;
  CudaDeviceGuard guard(index);
  cudaStream_t stream = current_stream(index);
  int64_t total = 0;
  for (size_t i = 0; i < srcs.size(); ++i) total += static_cast<int64_t>(srcs[i].nbytes());
  CopyTable table{};
  table.chunk_bytes = chunk_bytes_for(total);
  int pairs = 0, blocks = 0;
  auto launch = [&] {
    if (blocks > 0) {
      copy_multi_kernel<<<blocks, kThreads, 0, stream>>>(table);
      CHORUS_CUDA_LAUNCH_CHECK();
    }
    pairs = blocks = 0;
  };
  auto add_pair = [&](const char* s, char* d, int64_t bytes) {
    table.src[pairs] = s;
    table.dst[pairs] = d;
    table.bytes[pairs] = bytes;
    ++pairs;
  };
  for (size_t i = 0; i < srcs.size(); ++i) {
    const auto* s = static_cast<const char*>(srcs[i].raw_data());
    auto* d = static_cast<char*>(dsts[i].raw_data());
    const auto bytes = static_cast<int64_t>(srcs[i].nbytes());
    if (bytes == 0 || s == d) continue;
    if (pairs == kCopyPairs) launch();
    add_pair(s, d, bytes);
    for (int64_t c = 0; c * table.chunk_bytes < bytes; ++c) {
      if (blocks == kCopyBlocks) {
        launch();
        add_pair(s, d, bytes);  // the pair continues in the next launch, as its first entry
      }
      table.pair[blocks] = static_cast<uint8_t>(pairs - 1);
      table.chunk[blocks] = static_cast<int32_t>(c);
      ++blocks;
    }
  }
  launch();
}

}  // namespace chorus::cuda
