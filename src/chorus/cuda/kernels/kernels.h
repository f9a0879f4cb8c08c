// The CUDA kernel set (see core/kernel_set.h for the contract), for tensors on
// one CUDA device. Each kernel is enqueued on the current stream of that device
// and returns without waiting.
#pragma once

#include <string>

#include "chorus/core/kernel_set.h"

namespace chorus::cuda {
CHORUS_DECLARE_KERNELS

// Why cuDNN last refused a fused attention graph ("" if never): the detail of
// the error a caller who asked for the fused kernel gets (flash_attention.cpp).
std::string fused_attention_refusal();
}  // namespace chorus::cuda
