// Kernel profiling for finding slow ops: with CHORUS_PROFILE=1 in the
// environment, every kernel-set call through CHORUS_KERNEL synchronises its
// device before and after and adds the time to a per-kernel table printed to
// stderr at exit. Off (one branch per call) otherwise. The synchronisation
// changes the timing of an asynchronous program: use it to rank kernels, not
// to measure throughput.
#pragma once

#include "chorus/core/device.h"

namespace chorus::ops {

bool profiling_enabled();
// Forgets the times gathered so far (a benchmark calls it after its warm-up,
// so one-off costs such as cuDNN's algorithm search stay out of the table).
void reset_profile();

class ProfileScope {
 public:
  ProfileScope(const char* kernel, const Device& d);
  ~ProfileScope();
  ProfileScope(const ProfileScope&) = delete;
  ProfileScope& operator=(const ProfileScope&) = delete;

 private:
  const char* kernel_ = nullptr;
  Device device_;
  double start_ = 0;
};

}  // namespace chorus::ops
