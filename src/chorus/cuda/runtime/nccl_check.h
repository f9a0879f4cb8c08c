// CHORUS_NCCL_CHECK: an NCCL call's failure as DeviceError, with NCCL's name
// for the status and the call. For code built with NCCL (CHORUS_WITH_NCCL):
// cuda/runtime/nccl.cpp (in-process collectives) and distributed/'s NCCL process groups,
// whose failures are DistError (Errors in DESIGN.md): CHORUS_NCCL_CHECK_T(
// DistError, call), or nccl_error_message() inside a message of their own
// (operation, sequence number, ranks).
#pragma once

#include <nccl.h>

#include <string>

#include "chorus/core/error.h"
#include "chorus/core/graph_capture.h"

namespace chorus::cuda {

// "NCCL error: <name> in <call>[ over <where>][ (<NCCL's last error>)]". NCCL
// is asked for its last error only when `comm` is given; `where` may be empty.
std::string nccl_error_message(ncclResult_t r, const char* call, ncclComm_t comm, const std::string& where = "");

// Throws Kind (a chorus::Error) with nccl_error_message and file:line.
template <typename Kind = DeviceError>
[[noreturn]] void throw_nccl_error(ncclResult_t r, const char* call, ncclComm_t comm, const std::string& where,
                                   const char* file, int line) {
  std::string message = nccl_error_message(r, call, comm, where);
  note_capture_error(message);  // why a CUDA graph capture failed, if one is in progress
  throw Kind(message, file, line);
}
// CHORUS_NCCL_CHECK's thrower (no communicator, no place).
template <typename Kind>
[[noreturn]] void throw_nccl_status(ncclResult_t r, const char* call, const char* file, int line) {
  throw_nccl_error<Kind>(r, call, nullptr, "", file, line);
}

}  // namespace chorus::cuda

#define CHORUS_NCCL_CHECK(call) \
  CHORUS_STATUS_CHECK(ncclResult_t, ncclSuccess, ::chorus::cuda::throw_nccl_status<::chorus::DeviceError>, call, #call)
#define CHORUS_NCCL_CHECK_T(Kind, call) \
  CHORUS_STATUS_CHECK(ncclResult_t, ncclSuccess, ::chorus::cuda::throw_nccl_status<::chorus::Kind>, call, #call)
