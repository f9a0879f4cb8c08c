// The CUDA kernel set (see core/kernel_set.h for the contract), for tensors on
// one CUDA device. Each kernel is enqueued on the current stream of that device
// and returns without waiting.
#pragma once

#include <cstdint>
#include <string>

#include "chorus/core/kernel_set.h"

namespace chorus::cuda {
CHORUS_DECLARE_KERNELS

// Why cuDNN last refused a fused attention graph ("" if never): the detail of
// the error a caller who asked for the fused kernel gets (flash_attention.cpp).
std::string fused_attention_refusal();

// Note [Attention plan search] (flash_attention.cpp): whether fused attention
// takes cuDNN's first plan untimed (CHORUS_ATTENTION_SEARCH=heuristic, or
// deterministic mode); the setter (tests) overrides the environment. And how
// many problems have been searched (timed) in this process.
bool heuristic_attention_plans();
void set_heuristic_attention_plans(bool on);
int64_t attention_searches_run();
}  // namespace chorus::cuda
