// Large host blocks kept for reuse by the CPU backend (Note [Host block cache]).
#pragma once

#include <cstddef>

namespace chorus::detail {

// A 64-byte aligned block of at least `nbytes`; its real size (what
// host_free must be given back) in *got. nullptr when the system has no
// memory left even after the cache was emptied.
void* host_alloc(size_t nbytes, size_t* got);
void host_free(void* block, size_t size) noexcept;
// Bytes held by the cache for reuse (shared by every logical CPU device).
size_t host_cached_bytes();
void host_empty_cache();

}  // namespace chorus::detail
