// A convolution's shape for the GPU convolution paths' tests (the GEMM path,
// the direct kernels): its name, geometry and parameters, and its tensors in
// a dtype, channels-last, on a device.
#pragma once

#include <string>

#include <chorus/chorus.h>
#include <chorus/ops/copy.h>

namespace chorus::test {

struct ConvCase {
  int64_t n, c, h, w, k, kernel, stride, pad, dil;

  std::string name(DType dt) const {
    return std::to_string(n) + "x" + std::to_string(c) + "x" + std::to_string(h) + "x" + std::to_string(w) +
           " -> " + std::to_string(k) + " k" + std::to_string(kernel) + " s" + std::to_string(stride) + " p" +
           std::to_string(pad) + " d" + std::to_string(dil) + " " + dtype_name(dt);
  }
  nn::functional::Conv2dParams params() const { return {stride, stride, pad, pad, dil, dil, 1}; }
  Conv2dGeometry geometry() const { return {n, c, h, w, k, kernel, kernel, stride, stride, pad, pad, dil, dil, 1}; }
};

// t on d in dtype dt, channels-last.
inline Tensor channels_last_on(const Tensor& t, const Device& d, DType dt) {
  return ops::to_channels_last(t.to(d).to(dt));
}

}  // namespace chorus::test
