#include "chorus/core/range_arena.h"

#include <iterator>

#include "chorus/core/error.h"

namespace chorus::detail {

void RangeArena::add_segment(uintptr_t base, size_t size, Key key) {
  CHORUS_CHECK(size > 0, "RangeArena: an empty segment");
  auto next = segments_.lower_bound(base);
  CHORUS_CHECK(next == segments_.end() || next->first >= base + size, "RangeArena: segments overlap");
  if (next != segments_.begin()) {
    auto prev = std::prev(next);
    CHORUS_CHECK(prev->first + prev->second <= base, "RangeArena: segments overlap");
  }
  segments_.emplace(base, size);
  segment_bytes_ += size;
  insert_free(base, size, key);
}

std::pair<uintptr_t, uintptr_t> RangeArena::segment_of(uintptr_t addr) const {
  auto it = segments_.upper_bound(addr);
  CHORUS_CHECK(it != segments_.begin(), "RangeArena: ", addr, " is in no segment");
  --it;
  CHORUS_CHECK(addr < it->first + it->second, "RangeArena: ", addr, " is in no segment");
  return {it->first, it->first + it->second};
}

void RangeArena::insert_free(uintptr_t addr, size_t size, Key key) {
  free_.emplace(addr, Range{size, key});
  by_size_[key].emplace(size, addr);
  free_bytes_ += size;
}

void RangeArena::erase_free(std::map<uintptr_t, Range>::iterator it) {
  auto k = by_size_.find(it->second.key);
  k->second.erase({it->second.size, it->first});
  if (k->second.empty()) by_size_.erase(k);
  free_bytes_ -= it->second.size;
  free_.erase(it);
}

std::optional<RangeArena::Taken> RangeArena::take(size_t size, Key key) {
  auto k = by_size_.find(key);
  if (k == by_size_.end() || size == 0) return std::nullopt;
  auto best = k->second.lower_bound({size, 0});
  if (best == k->second.end()) return std::nullopt;
  const auto [have, addr] = *best;
  erase_free(free_.find(addr));  // invalidates `best` and maybe `k`
  Taken t{addr, have};
  if (have - size >= min_remainder_ && have > size) {
    t.size = size;
    insert_free(addr + size, have - size, key);
  }
  return t;
}

void RangeArena::give(uintptr_t addr, size_t size, Key key) {
  const auto [seg_begin, seg_end] = segment_of(addr);
  CHORUS_CHECK(size > 0 && addr + size <= seg_end, "RangeArena: a block past its segment's end");
  uintptr_t begin = addr, end = addr + size;
  auto next = free_.lower_bound(addr);
  CHORUS_CHECK(next == free_.end() || next->first >= end, "RangeArena: a block freed twice");
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    CHORUS_CHECK(prev->first + prev->second.size <= addr, "RangeArena: a block freed twice");
    // The range ending here, of the same stream and the same segment.
    if (prev->first + prev->second.size == addr && prev->first >= seg_begin && prev->second.key == key) {
      begin = prev->first;
      erase_free(prev);
    }
  }
  next = free_.lower_bound(end);
  if (next != free_.end() && next->first == end && end < seg_end && next->second.key == key) {
    end += next->second.size;
    erase_free(next);
  }
  insert_free(begin, end - begin, key);
}

size_t RangeArena::largest_free(Key key) const {
  auto k = by_size_.find(key);
  return k == by_size_.end() || k->second.empty() ? 0 : k->second.rbegin()->first;
}

}  // namespace chorus::detail
