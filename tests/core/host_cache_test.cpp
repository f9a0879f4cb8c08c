// The CPU backend's cache of large host blocks (Note [Host block cache]):
// a freed block of 1 MiB or more is reused by the next request of its size,
// bytes_in_use stays exact, small blocks and empty_cache give memory back.
#include <gtest/gtest.h>

#include <chorus/chorus.h>

#include "chorus/core/backend.h"

namespace chorus {
namespace {

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kAsan = true;
#else
constexpr bool kAsan = false;
#endif

TEST(HostCache, LargeBlocksAreReusedAndCountedExactly) {
  const Device cpu = cpu_device(0);
  DeviceBackend& be = backend(cpu);
  be.empty_cache(cpu);
  const size_t base = be.bytes_in_use(cpu);
  const int64_t n = (3 << 20) / 4 + 5;  // 3 MiB and a little: rounded up to the cache's 256 KiB steps
  void* first = nullptr;
  {
    Tensor t = empty({n}, TensorOptions(kFloat32, cpu));
    first = t.raw_data();
    EXPECT_EQ(be.bytes_in_use(cpu) - base, (static_cast<size_t>(n) * 4 + 63) / 64 * 64);
    EXPECT_EQ(be.cached_bytes(cpu), 0u);
  }
  EXPECT_EQ(be.bytes_in_use(cpu), base);
  EXPECT_GE(be.cached_bytes(cpu), static_cast<size_t>(n) * 4);
  {
    Tensor again = empty({n - 100}, TensorOptions(kFloat32, cpu));  // a little smaller: the same block serves it
    EXPECT_EQ(again.raw_data(), first);
    EXPECT_EQ(be.cached_bytes(cpu), 0u);
  }
  {  // another logical CPU device shares the host's cache
    Tensor on1 = empty({n}, TensorOptions(kFloat32, cpu_device(1)));
    EXPECT_EQ(on1.raw_data(), first);
  }
  be.empty_cache(cpu);
  EXPECT_EQ(be.cached_bytes(cpu), 0u);
}

TEST(HostCache, SmallBlocksAndMuchSmallerRequestsAreNotServedFromIt) {
  const Device cpu = cpu_device(0);
  DeviceBackend& be = backend(cpu);
  be.empty_cache(cpu);
  { Tensor small = empty({1000}, TensorOptions(kFloat32, cpu)); }
  EXPECT_EQ(be.cached_bytes(cpu), 0u);
  { Tensor big = empty({4 << 20}, TensorOptions(kFloat32, cpu)); }  // 16 MiB kept
  const size_t kept = be.cached_bytes(cpu);
  EXPECT_GE(kept, size_t{16} << 20);
  { Tensor half = empty({2 << 20}, TensorOptions(kFloat32, cpu)); }  // 8 MiB: not carved from the 16 MiB block
  EXPECT_GE(be.cached_bytes(cpu), kept + (size_t{8} << 20));
  be.empty_cache(cpu);
  EXPECT_EQ(be.cached_bytes(cpu), 0u);
}

// Under AddressSanitizer a block waiting in the cache is poisoned: touching
// it through a pointer kept from its freed tensor is reported.
TEST(HostCache, UseAfterFreeOfACachedBlockIsReportedUnderAsan) {
  if (!kAsan) GTEST_SKIP() << "needs AddressSanitizer (CI's build)";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        float* stale = nullptr;
        {
          Tensor t = empty({1 << 20}, TensorOptions(kFloat32, cpu_device(0)));
          stale = static_cast<float*>(t.raw_data());
        }
        volatile float v = stale[12345];
        (void)v;
      },
      "use-after-poison");
}

}  // namespace
}  // namespace chorus
