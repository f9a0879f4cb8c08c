// CUPTI's activity API, decoded: the kernels, copies and memsets a GPU ran,
// with their start and end on CUPTI's clock. Shared by the step traces of
// `chorus train|bench --trace` (ops/device_trace.cpp, Note [Device tracks])
// and the injection library bench/kernel_trace (which compiles this file
// into itself: it depends on CUPTI and the standard library only).
// Built when CMake finds CUPTI (CHORUS_WITH_CUPTI).
#pragma once

#if defined(CHORUS_WITH_CUPTI)

#include <cupti.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace chorus::cuda {

struct ActivityRecord {
  enum Kind { kKernel, kMemcpy, kMemset };
  Kind kind = kKernel;
  uint64_t start_ns = 0, end_ns = 0;  // CUPTI's clock (cuptiGetTimestamp)
  uint32_t device = 0, stream = 0;    // the CUDA device; CUPTI's id of the stream, unique within its context
  const char* name = nullptr;         // a kernel's (mangled) name; valid during the callback only
  uint64_t bytes = 0;                 // copies and memsets
  int copy_kind = 0;                  // CUpti_ActivityMemcpyKind; -1 for a peer copy (dst_device)
  uint32_t dst_device = 0;
};

// Calls `each` for every kernel, copy (host/device and peer) and memset
// record of one completed activity buffer; other records are skipped.
void decode_activity_buffer(uint8_t* buffer, size_t valid, const std::function<void(const ActivityRecord&)>& each);

// Turns the recording of those kinds on or off (concurrent kernels: the
// recording does not serialise them). Returns "" or what failed.
std::string enable_activity(bool on);

// CUPTI's buffer request callback: 8 MB buffers from aligned_alloc (free()
// them once decoded).
void CUPTIAPI activity_buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records);

// "what failed: CUPTI's message", or "" for CUPTI_SUCCESS.
std::string cupti_failure(CUptiResult r, const char* what);

// "HtoD", "DtoH", "DtoD", "peer", ... for ActivityRecord::copy_kind.
const char* copy_kind_name(int kind);

}  // namespace chorus::cuda

#endif
