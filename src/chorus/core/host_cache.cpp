// Note [Host block cache]
// glibc serves blocks over its mmap threshold (at most 32 MiB) with a fresh
// mmap and returns them with munmap, and trims the heap's top as blocks are
// freed: every large activation of a CPU training step or evaluation (a
// batch of 500 Fashion-MNIST images through the CNN makes 50 MB ones) is
// paged in and zeroed by the kernel again on every step. On the 2-core CI
// machine most of an evaluation of the 10,000 test images was that system
// time, and keeping the pages made it several times faster (measured when
// the cache was written; not in the benchmarks journal). So blocks of 1 MiB and more
// are kept here when freed, keyed by size (rounded up to 256 KiB, so a
// block serves requests up to a quarter smaller than itself), and reused as
// the CUDA allocator reuses device blocks. The cache holds at most
// CHORUS_CPU_CACHE_MB (default 2048; 0 turns it off) and gives everything
// back when an allocation fails.
#include "chorus/core/env_switches.h"
#include "chorus/core/host_cache.h"

#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>

#include "chorus/core/error.h"

namespace chorus::detail {
namespace {

// Under AddressSanitizer a cached block is poisoned while it waits: a use
// after free of it is still reported (as use-after-poison), and reusing it
// spares the sanitizer's allocator, which pages every large block in afresh
// (a CPU training step ran many times slower under ASan, much of it in page faults).
#if defined(__SANITIZE_ADDRESS__)
#define CHORUS_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CHORUS_ASAN 1
#endif
#endif
#ifdef CHORUS_ASAN
#include <sanitizer/asan_interface.h>
#define CHORUS_POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define CHORUS_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define CHORUS_POISON(p, n) ((void)(p), (void)(n))
#define CHORUS_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

constexpr size_t kMinCached = size_t{1} << 20;
constexpr size_t kGranule = size_t{256} << 10;

size_t limit_from_env() {
  const char* s = chorus::env::get("CHORUS_CPU_CACHE_MB");
  if (!s || !*s) return size_t{2048} << 20;
  char* end = nullptr;
  const unsigned long long mb = std::strtoull(s, &end, 10);
  CHORUS_CHECK(*end == '\0' && s[0] != '-' && mb <= (size_t{1} << 24), "CHORUS_CPU_CACHE_MB must be a number of MiB from 0 to ",
               size_t{1} << 24, ", got '", s, "'");
  return static_cast<size_t>(mb) << 20;
}

struct Cache {
  std::mutex mu;
  std::multimap<size_t, void*> free_blocks;  // size -> block
  size_t held = 0;
  const size_t limit = limit_from_env();

  void release_all() {
    std::multimap<size_t, void*> blocks;
    {
      std::lock_guard<std::mutex> lock(mu);
      blocks.swap(free_blocks);
      held = 0;
    }
    for (auto& [size, p] : blocks) {
      CHORUS_UNPOISON(p, size);
      std::free(p);
    }
  }
};

// Never destroyed: tensors freed during static destruction still find it.
Cache& cache() {
  static Cache* c = new Cache;
  return *c;
}

}  // namespace

void* host_alloc(size_t nbytes, size_t* got) {
  Cache& c = cache();
  size_t n = nbytes;
  if (n > (size_t{1} << 62)) return nullptr;  // no system has it; rounding up must not wrap
  if (c.limit > 0 && n >= kMinCached) {
    n = (n + kGranule - 1) / kGranule * kGranule;
    std::lock_guard<std::mutex> lock(c.mu);
    auto it = c.free_blocks.lower_bound(n);
    if (it != c.free_blocks.end() && it->first <= n + n / 4) {
      void* p = it->second;
      CHORUS_UNPOISON(p, it->first);
      *got = it->first;
      c.held -= it->first;
      c.free_blocks.erase(it);
      return p;
    }
  }
  void* p = std::aligned_alloc(64, n);
  if (!p && c.held > 0) {
    c.release_all();
    p = std::aligned_alloc(64, n);
  }
  *got = n;
  return p;
}

void host_free(void* block, size_t size) noexcept {
  Cache& c = cache();
  if (c.limit > 0 && size >= kMinCached && size % kGranule == 0) {
    std::lock_guard<std::mutex> lock(c.mu);
    if (c.held + size <= c.limit) {
      CHORUS_POISON(block, size);
      c.free_blocks.emplace(size, block);
      c.held += size;
      return;
    }
  }
  std::free(block);
}

size_t host_cached_bytes() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  return c.held;
}

void host_empty_cache() { cache().release_all(); }

}  // namespace chorus::detail
