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

// The same training run within `tol` (0: bit for bit): each loss relative to
// the reference's, each named tensor (a state dict) by rel_err.
inline void expect_same_training(const std::vector<double>& losses, const nn::NamedTensors& state,
                                 const std::vector<double>& ref_losses, const nn::NamedTensors& ref_state,
                                 double tol) {
  ASSERT_EQ(losses.size(), ref_losses.size());
  for (size_t i = 0; i < ref_losses.size(); ++i)
    EXPECT_NEAR(losses[i], ref_losses[i], tol * std::abs(ref_losses[i])) << "step " << i;
  ASSERT_EQ(state.size(), ref_state.size());
  for (size_t i = 0; i < ref_state.size(); ++i)
    EXPECT_LE(rel_err(state[i].second, ref_state[i].second), tol) << ref_state[i].first;
}

}  // namespace chorus::test
