// Helpers shared by the transformer ops' tests on the CPU
// (tests/nn/transformer_ops_test.cpp) and on a GPU against the CPU
// (tests/cuda/transformer_ops_cuda_test.cpp): index tensors and the largest
// elementwise difference of two tensors.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <chorus/chorus.h>

namespace chorus::test {

inline Tensor ids(const std::vector<int64_t>& v, const Shape& s) { return from_vector(v, s, {kInt64}); }

// max |a - b| in double on the host; a and b may live on any device, in any
// dtype and layout.
inline double max_abs_diff(const Tensor& a, const Tensor& b) {
  auto x = a.to(cpu_device(0), kFloat64).contiguous().to_vector<double>();
  auto y = b.to(cpu_device(0), kFloat64).contiguous().to_vector<double>();
  EXPECT_EQ(x.size(), y.size());
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) m = std::max(m, std::abs(x[i] - y[i]));
  return m;
}

}  // namespace chorus::test
