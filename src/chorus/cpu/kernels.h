// The CPU kernel set (see core/kernel_set.h for the contract).
#pragma once

#include "chorus/core/kernel_set.h"

namespace chorus::cpu {
CHORUS_DECLARE_KERNELS
}  // namespace chorus::cpu
