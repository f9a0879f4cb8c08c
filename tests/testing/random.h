// Random test inputs, one definition for every test: uniform values in
// [lo, hi) from a seeded mt19937, so a failure reproduces from its seed.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace chorus::testing {

inline std::vector<float> random_vector(size_t size, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(size);
  for (float& e : v) e = dist(gen);
  return v;
}

// The same in double, for references computed in double.
inline std::vector<double> random_doubles(size_t size, uint32_t seed, double lo = -1.0, double hi = 1.0) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> v(size);
  for (double& e : v) e = dist(gen);
  return v;
}

}  // namespace chorus::testing
