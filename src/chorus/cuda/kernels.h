// The CUDA kernel set (see core/kernel_set.h for the contract), for tensors on
// one CUDA device. Each kernel is enqueued on the current stream of that device
// and returns without waiting.
#pragma once

#include "chorus/core/kernel_set.h"

namespace chorus::cuda {
CHORUS_DECLARE_KERNELS
}  // namespace chorus::cuda
