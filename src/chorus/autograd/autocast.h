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

// Note [Autocast weight copies]: under autocast every convolution and matrix
// product cast its float32 weight to bfloat16 on every step (WRN-28-10: 29
// cast kernels a step, reading 146 MB of weights; benchmarks journal, session
// 12). A float32 leaf that requires grad (a parameter) now keeps its copy
// from one step to the next: autocast_weight() reuses it while the parameter is
// unchanged since (its version counter says so), and the SGD and AdamW
// optimizers write the copy in the same kernel that updates the parameter (a
// dense one; session 40: before AdamW did, a gpt2 step cast its 99 weights
// afresh, 0.36 ms), so the next step's forward finds it current and casts
// nothing. Any other change (an optimizer or update path that does not write
// copies, load_state_dict, an in-place op) bumps the
// version and the next use casts afresh. The copy is made outside CUDA graph
// captures only (a capture's memory belongs to its graph); a capture that finds
// a current copy uses it, and its replays stay consistent because the captured
// optimizer keeps writing it. A copy is freed when its parameter is.
//
// The autocast copy of weight `w` in `dt`, as a differentiable cast (the
// gradient comes back to w in w's dtype).
Tensor autocast_weight(const Tensor& w, DType dt);
// The same copy, not recorded: for an op that records `w` itself as its input
// and returns w's gradient in w's dtype (autograd::conv2d's weight_data,
// autograd::linear_bias's and mlp_gelu's copies).
Tensor autocast_weight_data(const Tensor& w, DType dt);
// For an optimizer about to update `param` in place: its kept copy when that
// copy is current (undefined otherwise). Write the update into it too, then
// call autocast_copy_written(param) after bumping param's version.
Tensor autocast_copy_for_update(const Tensor& param);
void autocast_copy_written(const Tensor& param);
// Parameters with a kept copy (tests and diagnostics).
size_t autocast_copies_kept();

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
