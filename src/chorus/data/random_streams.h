// The data layer's random numbers: Philox keyed by a user seed, with the
// 128-bit counter split so that shuffling, augmentation and synthetic data
// never share a counter.
//
// Every draw is a pure function of (seed, stream, a, b), typically
// (seed, shuffle, position, epoch) or (seed, transform slot, index, epoch).
// No generator state is advanced, so results do not depend on which worker
// thread asks, in what order, or whether the run was restarted mid-epoch.
#pragma once

#include <cstdint>

#include "chorus/core/philox.h"

namespace chorus::data::detail {

enum class Stream : uint64_t {
  kShuffle = 1,
  kSyntheticPattern = 2,
  kSyntheticNoise = 3,
  kTransform = 16,  // + the transform's position in the pipeline
};

// Counter = (a, stream << 56 | b): b keeps 56 bits, far more than any epoch.
inline philox::U4 random4(uint64_t seed, uint64_t stream, uint64_t a, uint64_t b) {
  return philox::philox4x32(seed, a, (stream << 56) | (b & ((uint64_t{1} << 56) - 1)));
}
inline philox::U4 random4(uint64_t seed, Stream s, uint64_t a, uint64_t b) {
  return random4(seed, static_cast<uint64_t>(s), a, b);
}

// Uniform integer in [0, n) from two words: 64 random bits scaled by n
// (Lemire's multiply-shift); the bias is below n / 2^64.
inline uint64_t below(uint32_t hi, uint32_t lo, uint64_t n) {
  const uint64_t r = (uint64_t{hi} << 32) | lo;
  return static_cast<uint64_t>((static_cast<unsigned __int128>(r) * n) >> 64);
}

}  // namespace chorus::data::detail
