// The random number generator: a seed and a counter offset for Philox.
// Each random op reserves a range of counters (offset advances by the number
// of 4-word blocks it uses), so the stream of numbers depends only on the seed
// and the order of random ops, never on threads or devices.
#pragma once

#include <cstdint>
#include <mutex>

namespace chorus {

struct RngState {
  uint64_t seed = 0;
  uint64_t offset = 0;
};

class Generator {
 public:
  explicit Generator(uint64_t seed = 0x5eed) { state_.seed = seed; }
  void manual_seed(uint64_t seed);
  // Reserves counters for `n` random words and returns (seed, first offset).
  RngState reserve(uint64_t n_words);
  RngState state() const;
  void set_state(const RngState& s);

 private:
  mutable std::mutex mu_;
  RngState state_;
};

// The process-wide generator used by rand/randn/dropout/shuffling.
Generator& default_generator();
void manual_seed(uint64_t seed);

}  // namespace chorus
