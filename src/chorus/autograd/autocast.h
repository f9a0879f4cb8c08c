// Mixed precision (PyTorch's autocast): inside an AutocastGuard, matrix
// products and convolutions on CUDA devices run in the autocast dtype (bf16 on
// tensor cores) while parameters stay float32 master weights; the casts are
// differentiable, so gradients reach the parameters in float32. Batch-norm
// statistics and the loss are computed in float32 by their kernels.
#pragma once

#include <optional>

#include "chorus/core/dtype.h"
#include "chorus/core/tensor.h"

namespace chorus {

// The dtype ops should compute in for `t`, when autocast applies to it.
std::optional<DType> autocast_dtype(const Tensor& t);
// This thread's autocast dtype (nullopt: autocast off). The state is per
// thread; code that runs work on other threads on the caller's behalf
// (parallel::DeviceThreads) reads it here and sets it there with a guard.
std::optional<DType> current_autocast();

class AutocastGuard {
 public:
  explicit AutocastGuard(std::optional<DType> dtype = kBFloat16);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  std::optional<DType> prev_;
};

}  // namespace chorus
