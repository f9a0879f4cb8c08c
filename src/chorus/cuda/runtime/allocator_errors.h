// Error handling the CUDA allocator's files share (allocator.cpp,
// allocator_pools.cpp).
#pragma once

#include <cuda_runtime.h>

#include "chorus/core/warn.h"

namespace chorus::cuda::detail {

// For noexcept paths (frees, event releases): report and carry on. During
// process exit the runtime may already be gone; that is not worth a message.
inline void warn_if_failed(cudaError_t err, const char* what) noexcept {
  if (err == cudaSuccess) return;
  (void)cudaGetLastError();
  if (err == cudaErrorCudartUnloading || err == cudaErrorContextIsDestroyed) return;
  warnf(what, " failed: ", cudaGetErrorString(err));
}
inline bool is_allocation_failure(cudaError_t err) {
  // An absurd request (more than the device could ever map) may come back as
  // an invalid value rather than as out of memory; both mean "no memory".
  return err == cudaErrorMemoryAllocation || err == cudaErrorInvalidValue;
}

}  // namespace chorus::cuda::detail
