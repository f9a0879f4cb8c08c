// The CUDA allocator's front cache (Note [Allocator front cache] in
// cuda/runtime/allocator.h): size classes; same-stream reuse without CUDA calls or pool
// growth; no hand-over of a cached block to another stream; release on
// out-of-memory, on stream destruction and on request; the caps; bytes_in_use
// counting live tensors only; several threads on one device. Most tests use a
// private CudaAllocator (on the same CUDA pools as the backend's), so that the
// cache is on and its limits are known whatever CHORUS_CUDA_CACHE says; the
// backend's own cache is checked through DeviceBackend.
#ifdef CHORUS_WITH_CUDA

#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "chorus/core/backend.h"
#include "chorus/core/env_switches.h"
#include "chorus/core/error.h"
#include "chorus/core/persistent_alloc.h"
#include "chorus/core/tensor.h"
#include "chorus/cuda/runtime/allocator.h"
#include "chorus/cuda/kernels/kernels.h"

namespace chorus {
namespace {

using cuda::CudaAllocator;
using cuda::EventPool;

const Device kGpu = cuda_device(0);
const Device kHost = cpu_device(0);
constexpr size_t kMiB = size_t{1} << 20;

// Bytes of device 0's default pool handed out (to either allocator).
size_t pool_used() {
  cudaMemPool_t pool;
  EXPECT_EQ(cudaDeviceGetDefaultMemPool(&pool, 0), cudaSuccess);
  uint64_t v = 0;
  EXPECT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &v), cudaSuccess);
  return static_cast<size_t>(v);
}

std::vector<uint8_t> read_back(const void* ptr, size_t n) {
  std::vector<uint8_t> out(n);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(out.data(), ptr, n, cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

// A private allocator with the cache on and generous limits.
struct Fixture {
  EventPool events{cuda_device_count()};
  CudaAllocator alloc{cuda_device_count(), &events};
  Fixture() {
    alloc.set_cache_enabled(true);
    alloc.set_cache_limits(256 * kMiB, 1024 * kMiB);
  }
  ~Fixture() {
    for (int d = 0; d < cuda_device_count(); ++d) alloc.release_cached(d);
  }
};

// A stream of the backend, current for this thread while the guard lives; the
// private allocator is told before it is destroyed, as the backend tells its own.
struct ScopedStream {
  CudaAllocator* alloc;
  StreamHandle s;
  explicit ScopedStream(CudaAllocator* a) : alloc(a), s(backend(kGpu).create_stream(kGpu)) {}
  void make_current() const { backend(kGpu).set_current_stream(kGpu, s); }
  cudaStream_t raw() const { return static_cast<cudaStream_t>(s); }
  ~ScopedStream() {
    backend(kGpu).set_current_stream(kGpu, nullptr);
    if (alloc) alloc->stream_destroyed(0, raw());
    backend(kGpu).destroy_stream(kGpu, s);
  }
};

TEST(CudaAllocatorCache, SizeClassesBoundTheSlack) {
  // No GPU needed: the rounding alone.
  EXPECT_EQ(CudaAllocator::size_class(1), 512u);
  EXPECT_EQ(CudaAllocator::size_class(512), 512u);
  EXPECT_EQ(CudaAllocator::size_class(513), 1024u);
  EXPECT_EQ(CudaAllocator::size_class(4096), 4096u);
  EXPECT_EQ(CudaAllocator::size_class(4097), 4608u);
  EXPECT_EQ(CudaAllocator::size_class(3 * kMiB), 3 * kMiB);
  EXPECT_EQ(CudaAllocator::size_class(100 * kMiB + 1), 102 * kMiB);
  std::mt19937_64 gen(7);
  for (int i = 0; i < 20000; ++i) {
    const size_t n = 1 + gen() % (size_t{1} << (1 + gen() % 31));
    const size_t c = CudaAllocator::size_class(n);
    ASSERT_GE(c, n);
    ASSERT_LE(c - n, std::max<size_t>(511, std::min(n / 8, 2 * kMiB))) << n;
    ASSERT_EQ(CudaAllocator::size_class(c), c) << n;  // a class is its own class
    ASSERT_LE(CudaAllocator::size_class(n - 1 + (n == 1)), c) << n;  // monotonic
  }
}

// Note [Persistent allocations]: inside the scope, blocks come from a pool of
// their own, their size rounded to 512 B, and a free never caches them.
TEST(CudaAllocatorCache, PersistentAllocationsComeFromAPoolOfTheirOwn_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  if (const char* e = env::get("CHORUS_CUDA_PERSISTENT_POOL"); e && std::string(e) == "0")
    GTEST_SKIP() << "CHORUS_CUDA_PERSISTENT_POOL=0";
  Fixture f;
  ScopedStream s(&f.alloc);
  s.make_current();
  const size_t n = 3 * kMiB + 100, used = pool_used();
  void* p = nullptr;
  {
    PersistentAllocations scope;
    EXPECT_TRUE(PersistentAllocations::active());
    p = f.alloc.allocate(n, 0);
  }
  EXPECT_FALSE(PersistentAllocations::active());
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(pool_used(), used);  // not from the common pool
  EXPECT_EQ(f.alloc.bytes_in_use(0), n);
  std::vector<uint8_t> bytes(n);
  std::mt19937 rng(7);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
  ASSERT_EQ(cudaMemcpy(p, bytes.data(), n, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(read_back(p, n), bytes);
  f.alloc.deallocate(p, 0);
  EXPECT_EQ(f.alloc.bytes_in_use(0), 0u);
  EXPECT_EQ(f.alloc.cached_bytes(0), 0u);  // back to its pool, not into the cache
  void* q = f.alloc.allocate(n, 0);  // outside the scope: the common pool
  EXPECT_GE(pool_used(), used + n);
  f.alloc.deallocate(q, 0);
}

TEST(CudaAllocatorCache, SameStreamReuseTakesTheCachedBlockWithoutGrowingThePool_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  Fixture f;
  ScopedStream s(&f.alloc);
  s.make_current();
  void* p = f.alloc.allocate(1000, 0);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(f.alloc.bytes_in_use(0), 1000u);  // requested bytes, not the class's 1024
  const size_t used = pool_used();
  f.alloc.deallocate(p, 0);
  EXPECT_EQ(f.alloc.bytes_in_use(0), 0u);
  EXPECT_EQ(f.alloc.cached_bytes(0), 1024u);
  EXPECT_EQ(pool_used(), used);  // the cache holds it; the pool did not get it back
  for (int i = 0; i < 100; ++i) {
    const size_t n = 513 + static_cast<size_t>(i) * 5;  // every size of the 1024-byte class
    void* q = f.alloc.allocate(n, 0);
    ASSERT_EQ(q, p) << n;
    EXPECT_EQ(f.alloc.cached_bytes(0), 0u);
    EXPECT_EQ(f.alloc.bytes_in_use(0), n);
    EXPECT_EQ(pool_used(), used);
    f.alloc.deallocate(q, 0);
  }
  // Another class is a miss: a new block from the pool.
  void* big = f.alloc.allocate(3 * kMiB, 0);
  EXPECT_NE(big, p);
  EXPECT_GE(pool_used(), used + 3 * kMiB);
  EXPECT_EQ(f.alloc.peak_bytes(0), 3 * kMiB);
  f.alloc.deallocate(big, 0);
  EXPECT_EQ(f.alloc.cached_bytes(0), 1024u + 3 * kMiB);
  // The cached block is still usable memory of the stream.
  void* r = f.alloc.allocate(3 * kMiB, 0);
  ASSERT_EQ(r, big);
  ASSERT_EQ(cudaMemsetAsync(r, 0x5A, 3 * kMiB, s.raw()), cudaSuccess);
  const auto bytes = read_back(r, 3 * kMiB);
  EXPECT_TRUE(std::all_of(bytes.begin(), bytes.end(), [](uint8_t b) { return b == 0x5A; }));
  f.alloc.deallocate(r, 0);
  f.alloc.release_cached(0);
  EXPECT_EQ(f.alloc.cached_bytes(0), 0u);
}

// A block freed on stream A stays in A's cache: stream B gets another block,
// even while A's last write to the freed block is still queued behind other
// work. Were the block handed to B, B's write could land first and be
// overwritten by A's.
TEST(CudaAllocatorCache, BlockFreedOnOneStreamIsNotHandedToAnother_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  Fixture f;
  ScopedStream a(&f.alloc), b(&f.alloc);
  const size_t n = 4 * kMiB;
  a.make_current();
  void* p = f.alloc.allocate(n, 0);
  Tensor busy = detail::empty_tensor({1 << 26}, kFloat32, kGpu);  // the backend's, on stream a
  for (int i = 0; i < 30; ++i) cuda::fill(busy, i);                // keeps a busy for a while
  ASSERT_EQ(cudaMemsetAsync(p, 0x11, n, a.raw()), cudaSuccess);
  f.alloc.deallocate(p, 0);
  EXPECT_EQ(f.alloc.cached_bytes(0), n);

  b.make_current();
  void* q = f.alloc.allocate(n, 0);
  EXPECT_NE(q, p);
  EXPECT_EQ(f.alloc.cached_bytes(0), n);  // p is still a's
  ASSERT_EQ(cudaMemsetAsync(q, 0x22, n, b.raw()), cudaSuccess);
  const auto got = read_back(q, n);
  EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](uint8_t x) { return x == 0x22; }));

  a.make_current();
  void* r = f.alloc.allocate(n, 0);
  EXPECT_EQ(r, p);  // back to its own stream
  f.alloc.deallocate(r, 0);
  b.make_current();
  f.alloc.deallocate(q, 0);
  a.make_current();
  busy = Tensor();
  f.alloc.release_cached(0);
}

// The cache held the memory a new request needs: the failed cudaMallocAsync
// gives the cache back to the pool and the retry succeeds.
TEST(CudaAllocatorCache, OutOfMemoryReleasesTheCacheAndSucceeds_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  DeviceBackend& be = backend(kGpu);
  be.empty_cache(kGpu);
  be.synchronize(kGpu);
  cudaMemPool_t pool;
  ASSERT_EQ(cudaDeviceGetDefaultMemPool(&pool, 0), cudaSuccess);
  ASSERT_EQ(cudaMemPoolTrimTo(pool, 0), cudaSuccess);
  size_t free = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free, &total), cudaSuccess);

  Fixture f;
  f.alloc.set_cache_limits(SIZE_MAX, SIZE_MAX);  // cache everything
  ScopedStream s(&f.alloc);
  s.make_current();
  const size_t quarter = free / 4 / (2 * kMiB) * (2 * kMiB);
  std::vector<void*> blocks;
  for (int i = 0; i < 3; ++i) blocks.push_back(f.alloc.allocate(quarter, 0));
  for (void* p : blocks) f.alloc.deallocate(p, 0);
  EXPECT_EQ(f.alloc.cached_bytes(0), 3 * quarter);
  EXPECT_EQ(f.alloc.bytes_in_use(0), 0u);

  // Half of what was free: more than is left outside the cache.
  const size_t half = 2 * quarter;
  void* big = nullptr;
  ASSERT_NO_THROW(big = f.alloc.allocate(half, 0));
  ASSERT_NE(big, nullptr);
  EXPECT_EQ(f.alloc.cached_bytes(0), 0u);
  EXPECT_EQ(f.alloc.bytes_in_use(0), half);
  ASSERT_EQ(cudaMemsetAsync(big, 0, half, s.raw()), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s.raw()), cudaSuccess);
  f.alloc.deallocate(big, 0);
  f.alloc.release_cached(0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(cudaMemPoolTrimTo(pool, 0), cudaSuccess);

  // A request nothing can satisfy still throws, with the usual message, and
  // leaves the accounting as it was.
  try {
    f.alloc.allocate(size_t{1} << 50, 0);
    FAIL() << "allocating 1 PiB succeeded";
  } catch (const OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("1.00 PiB"), std::string::npos) << e.what();
  }
  EXPECT_EQ(f.alloc.bytes_in_use(0), 0u);
}

TEST(CudaAllocatorCache, CapsSendBlocksBackToThePool_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  Fixture f;
  f.alloc.set_cache_limits(kMiB, 3 * kMiB);
  ScopedStream s(&f.alloc);
  s.make_current();
  void* large = f.alloc.allocate(kMiB + 1, 0);  // above the block cap: exact size, never cached
  f.alloc.deallocate(large, 0);
  EXPECT_EQ(f.alloc.cached_bytes(0), 0u);
  std::vector<void*> ps;
  for (int i = 0; i < 4; ++i) ps.push_back(f.alloc.allocate(kMiB, 0));
  for (void* p : ps) f.alloc.deallocate(p, 0);
  EXPECT_EQ(f.alloc.cached_bytes(0), 3 * kMiB);  // the fourth went to the pool
  f.alloc.set_cache_enabled(false);               // releases everything
  EXPECT_EQ(f.alloc.cached_bytes(0), 0u);
  void* p = f.alloc.allocate(kMiB, 0);
  f.alloc.deallocate(p, 0);
  EXPECT_EQ(f.alloc.cached_bytes(0), 0u);
}

TEST(CudaAllocatorCache, DestroyingAStreamFreesItsCachedBlocks_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  Fixture f;
  {
    ScopedStream s1(&f.alloc);
    ScopedStream s2(&f.alloc);
    s1.make_current();
    f.alloc.deallocate(f.alloc.allocate(kMiB, 0), 0);
    s2.make_current();
    f.alloc.deallocate(f.alloc.allocate(2 * kMiB, 0), 0);
    EXPECT_EQ(f.alloc.cached_bytes(0), 3 * kMiB);
    backend(kGpu).set_current_stream(kGpu, nullptr);
    f.alloc.stream_destroyed(0, s1.raw());  // as the backend does before cudaStreamDestroy
    EXPECT_EQ(f.alloc.cached_bytes(0), 2 * kMiB);
  }
  EXPECT_EQ(f.alloc.cached_bytes(0), 0u);
}

// The backend's allocator: bytes_in_use counts live tensors only; cached bytes
// are reported apart and released by empty_cache.
TEST(CudaAllocatorCache, BackendCountsLiveBytesAndReportsTheCacheApart_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  DeviceBackend& be = backend(kGpu);
  StreamHandle s = be.create_stream(kGpu);
  be.set_current_stream(kGpu, s);
  const size_t base = be.bytes_in_use(kGpu);
  const size_t cached = be.cached_bytes(kGpu);
  void* p = be.allocate(1000, kGpu);
  EXPECT_EQ(be.bytes_in_use(kGpu), base + 1000);
  EXPECT_GE(be.peak_bytes(kGpu), base + 1000);
  be.deallocate(p, kGpu);
  EXPECT_EQ(be.bytes_in_use(kGpu), base);
  // 1024 more cached, unless CHORUS_CUDA_CACHE=0 turned the cache off.
  EXPECT_TRUE(be.cached_bytes(kGpu) == cached + 1024 || be.cached_bytes(kGpu) == cached);
  void* q = be.allocate(1000, kGpu);
  EXPECT_EQ(be.bytes_in_use(kGpu), base + 1000);
  EXPECT_EQ(be.cached_bytes(kGpu), cached);
  be.deallocate(q, kGpu);
  be.set_current_stream(kGpu, nullptr);
  be.destroy_stream(kGpu, s);  // frees what was cached on s
  EXPECT_EQ(be.cached_bytes(kGpu), cached);
  be.empty_cache(kGpu);
  EXPECT_EQ(be.cached_bytes(kGpu), 0u);
  EXPECT_EQ(be.bytes_in_use(kGpu), base);
}

// Several threads allocating and freeing on one device (on its shared default
// stream): the cache's bookkeeping stays exact.
TEST(CudaAllocatorCache, ThreadsShareADeviceSafely_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  Fixture f;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&f, t] {
      std::mt19937 gen(static_cast<uint32_t>(t));
      std::vector<void*> live;
      for (int i = 0; i < 2000; ++i) {
        if (live.size() < 16 && gen() % 2) {
          live.push_back(f.alloc.allocate(1 + gen() % (64 << 10), 0));
        } else if (!live.empty()) {
          f.alloc.deallocate(live.back(), 0);
          live.pop_back();
        }
      }
      for (void* p : live) f.alloc.deallocate(p, 0);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(f.alloc.bytes_in_use(0), 0u);
  f.alloc.release_cached(0);
  EXPECT_EQ(f.alloc.cached_bytes(0), 0u);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace chorus

#endif  // CHORUS_WITH_CUDA
