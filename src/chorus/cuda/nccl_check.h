// CHORUS_NCCL_CHECK: NCCL's status codes as DeviceError (or DistError where
// the caller says so), with NCCL's own description of the failure and the
// call. For code built with NCCL (CHORUS_WITH_NCCL): cuda/nccl.cpp and the
// process groups of dist/.
#pragma once

#include <nccl.h>

#include <string>

namespace chorus::cuda {

// Throws DeviceError "NCCL error: <name> in <call>[ over <where>] (<NCCL's
// last error for comm>)". `comm` may be null; `where` may be empty.
[[noreturn]] void throw_nccl_error(ncclResult_t r, const char* call, ncclComm_t comm, const std::string& where,
                                   const char* file, int line);

}  // namespace chorus::cuda

#define CHORUS_NCCL_CHECK(call)                                                               \
  do {                                                                                        \
    ncclResult_t chorus_nccl_status_ = (call);                                                \
    if (chorus_nccl_status_ != ncclSuccess)                                                   \
      ::chorus::cuda::throw_nccl_error(chorus_nccl_status_, #call, nullptr, "", __FILE__, __LINE__); \
  } while (0)
