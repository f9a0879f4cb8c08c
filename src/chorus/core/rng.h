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

// The generator random ops draw from: the process-wide one used by
// rand/randn/dropout/shuffling, or this thread's GeneratorGuard's.
Generator& default_generator();

// RAII: random ops issued by this thread draw from `g` while it lives. A
// pipeline stage gives each (stage, micro-batch) its own generator, so a
// recomputed forward draws the same dropout masks as the first one whatever
// the other stages' threads drew in between.
class GeneratorGuard {
 public:
  explicit GeneratorGuard(Generator& g);
  ~GeneratorGuard();
  GeneratorGuard(const GeneratorGuard&) = delete;
  GeneratorGuard& operator=(const GeneratorGuard&) = delete;

 private:
  Generator* prev_;
};
void manual_seed(uint64_t seed);

}  // namespace chorus
