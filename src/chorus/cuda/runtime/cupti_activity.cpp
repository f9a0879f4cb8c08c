#include "chorus/cuda/runtime/cupti_activity.h"

#if defined(CHORUS_WITH_CUPTI)

#include <cstdlib>

namespace chorus::cuda {

namespace {
constexpr CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMSET,
                                         CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_MEMCPY2};
}  // namespace

std::string cupti_failure(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return "";
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  return std::string(what) + ": " + (msg ? msg : "unknown CUPTI error");
}

void decode_activity_buffer(uint8_t* buffer, size_t valid, const std::function<void(const ActivityRecord&)>& each) {
  CUpti_Activity* rec = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    ActivityRecord r;
    // Copies and memsets too: a gap between two kernels may be one (a
    // library's workspace cleared before its kernel).
    if (rec->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
      r = {ActivityRecord::kMemset, m->start, m->end, m->deviceId, m->streamId, nullptr, m->bytes, 0, 0};
    } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
      r = {ActivityRecord::kMemcpy, m->start, m->end, m->deviceId, m->streamId, nullptr, m->bytes, m->copyKind, 0};
    } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY2) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpyPtoP4*>(rec);
      r = {ActivityRecord::kMemcpy, m->start, m->end, m->deviceId, m->streamId, nullptr, m->bytes, -1, m->dstDeviceId};
    } else if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || rec->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
      r = {ActivityRecord::kKernel, k->start, k->end, k->deviceId, k->streamId, k->name, 0, 0, 0};
    } else {
      continue;
    }
    each(r);
  }
}

std::string enable_activity(bool on) {
  for (CUpti_ActivityKind k : kKinds) {
    std::string f = cupti_failure(on ? cuptiActivityEnable(k) : cuptiActivityDisable(k),
                                  on ? "cuptiActivityEnable" : "cuptiActivityDisable");
    if (!f.empty()) return f;
  }
  return "";
}

void CUPTIAPI activity_buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  constexpr size_t kBytes = size_t{8} << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBytes));
  *size = *buffer ? kBytes : 0;
  *max_records = 0;  // as many as fit
}

const char* copy_kind_name(int kind) {
  switch (kind) {
    case -1: return "peer";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "DtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH: return "HtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP: return "PtoP";
    default: return "array";
  }
}

}  // namespace chorus::cuda

#endif
