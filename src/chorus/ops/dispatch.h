// Dispatch from ops/ to the device kernel layers: one macro, so each op says
// which kernel it runs and the device decides where.
#pragma once

#include "chorus/cpu/kernels.h"
#ifdef CHORUS_WITH_CUDA
#include "chorus/cuda/kernels.h"
#define CHORUS_KERNEL(dev, name, ...) \
  ((dev).is_cuda() ? ::chorus::cuda::name(__VA_ARGS__) : ::chorus::cpu::name(__VA_ARGS__))
#else
#define CHORUS_KERNEL(dev, name, ...) ::chorus::cpu::name(__VA_ARGS__)
#endif
