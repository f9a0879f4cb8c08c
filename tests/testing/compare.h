// rel_err(a, b): max |a - b| / max |b| over all elements, computed on the host
// in double -- a norm-wise relative error that entries near zero cannot blow
// up. The tensors may live on any device, in any dtype and layout.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include <chorus/chorus.h>

namespace chorus::test {

inline double rel_err(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  const std::vector<float> va = a.to(cpu_device(0)).to(kFloat32).to_vector<float>();
  const std::vector<float> vb = b.to(cpu_device(0)).to(kFloat32).to_vector<float>();
  double diff = 0, scale = 0;
  for (size_t i = 0; i < va.size() && i < vb.size(); ++i) {
    diff = std::max(diff, std::abs(double(va[i]) - double(vb[i])));
    scale = std::max(scale, std::abs(double(vb[i])));
  }
  return diff / std::max(scale, 1e-12);
}

}  // namespace chorus::test
