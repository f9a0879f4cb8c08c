// How many training steps a multi-step GPU test runs. CHORUS_TEST_STEPS
// shortens them for runs under compute-sanitizer (racecheck instruments every
// cuDNN kernel: the 20-step graph test took 214 s under it), where every
// launch of every kernel is checked and the same kernels repeat each step.
// Never below `floor` (the warm-up steps plus one replay, for a graph test).
#pragma once

#include <algorithm>
#include <cstdlib>
#include <string>

namespace chorus::test {

inline int test_steps(int normal, int floor) {
  const char* env = std::getenv("CHORUS_TEST_STEPS");
  if (env == nullptr || *env == '\0') return normal;
  return std::clamp(std::atoi(env), floor, normal);
}

}  // namespace chorus::test
