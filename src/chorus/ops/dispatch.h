// Dispatch from ops/ to the device kernel layers: one macro, so each op says
// which kernel it runs and the device decides where.
#pragma once

#include "chorus/cpu/kernels.h"
#include "chorus/ops/profile.h"
// The ProfileScope temporary lives to the end of the full expression, i.e.
// around the kernel call (CHORUS_PROFILE=1; see profile.h).
#ifdef CHORUS_WITH_CUDA
#include "chorus/cuda/kernels/kernels.h"
#define CHORUS_KERNEL(dev, name, ...)                    \
  (::chorus::ops::ProfileScope(#name, (dev)),            \
   (dev).is_cuda() ? ::chorus::cuda::name(__VA_ARGS__) : ::chorus::cpu::name(__VA_ARGS__))
#else
#define CHORUS_KERNEL(dev, name, ...) \
  (::chorus::ops::ProfileScope(#name, (dev)), ::chorus::cpu::name(__VA_ARGS__))
#endif
