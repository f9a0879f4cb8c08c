// Deterministic cuDNN convolutions for a test's duration (RAII). cuDNN's
// fastest weight-gradient engines sum with atomics, so two runs of the same
// steps differ in the last bits; a test that compares two ways of computing
// the same steps bit for bit (or to 1e-6) uses only deterministic engines, so
// that any difference is the thing under test.
#pragma once

#ifdef CHORUS_WITH_CUDA

#include <chorus/cuda/blas/blas.h>

namespace chorus::test {

class DeterministicConvolutions {
 public:
  DeterministicConvolutions() : prev_(cuda::deterministic()) { cuda::set_deterministic(true); }
  ~DeterministicConvolutions() { cuda::set_deterministic(prev_); }
  DeterministicConvolutions(const DeterministicConvolutions&) = delete;
  DeterministicConvolutions& operator=(const DeterministicConvolutions&) = delete;

 private:
  bool prev_;
};

}  // namespace chorus::test

#endif  // CHORUS_WITH_CUDA
