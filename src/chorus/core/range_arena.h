// RangeArena: carves blocks out of segments of address space, best fit, and
// merges freed neighbours back together. Host-only bookkeeping (it never
// touches the memory), so it is tested on CPUs; the CUDA allocator's graph
// pools (Note [Graph pools] in cuda/runtime/allocator.h) hand it the segments
// they cudaMalloc.
//
// Note [Free ranges by stream]: every free range carries the key of the
// stream that freed it (a segment's first range, the stream it was made for).
// take() on a key uses only that key's ranges, and give() merges a range only
// with free neighbours of the same key and the same segment: memory freed on
// stream S is ordered after its last use on S alone, so only S may reuse it
// without an event, and two segments adjacent in address space are still two
// allocations that no block may straddle.
//
// Why splitting matters: a pool that reuses a freed block only for a request
// of the same size class (the front cache's rule) keeps a training step's
// freed activations idle while the backward asks for gradients of other
// sizes, so the graph's pool grew by about the gradients' size (5.75 GiB for
// gpt2-xl in a CUDA graph, against the stream-ordered pool of the eager step).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <utility>

namespace chorus::detail {

class RangeArena {
 public:
  using Key = const void*;
  struct Taken {
    uintptr_t addr = 0;
    size_t size = 0;  // at least the request: a remainder too small to keep goes with it
  };

  // `min_remainder`: a split leaves a free range of at least this many bytes,
  // else the whole range is taken (slivers would only fragment the arena).
  explicit RangeArena(size_t min_remainder = 0) : min_remainder_(min_remainder) {}

  // A new segment [base, base + size), free for `key`. Segments never overlap.
  void add_segment(uintptr_t base, size_t size, Key key);
  // The smallest free range of `key` that holds `size` bytes, split at its
  // start; nullopt when none does.
  std::optional<Taken> take(size_t size, Key key);
  // [addr, addr + size), taken earlier, is free again, for `key`.
  void give(uintptr_t addr, size_t size, Key key);

  size_t segment_bytes() const { return segment_bytes_; }
  size_t free_bytes() const { return free_bytes_; }
  size_t free_ranges() const { return free_.size(); }
  size_t segments() const { return segments_.size(); }
  // The largest free range of `key` (0 when it has none).
  size_t largest_free(Key key) const;

 private:
  struct Range {
    size_t size;
    Key key;
  };
  void insert_free(uintptr_t addr, size_t size, Key key);
  void erase_free(std::map<uintptr_t, Range>::iterator it);
  // The segment holding `addr`: its [base, end).
  std::pair<uintptr_t, uintptr_t> segment_of(uintptr_t addr) const;

  size_t min_remainder_;
  std::map<uintptr_t, size_t> segments_;                   // base -> size
  std::map<uintptr_t, Range> free_;                        // by address, for merging
  std::map<Key, std::set<std::pair<size_t, uintptr_t>>> by_size_;  // per key, for best fit
  size_t segment_bytes_ = 0, free_bytes_ = 0;
};

}  // namespace chorus::detail
