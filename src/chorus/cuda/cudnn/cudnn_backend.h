// cuDNN's backend (graph) API, the pieces its users share: an owned
// descriptor, reading descriptor lists back, and the heuristics' engine
// configurations for an operation graph. Used by the convolution plans
// (conv_plan.cpp) and the fused attention (flash_attention.cpp). Include only
// from src/chorus/cuda.
#pragma once

#include <vector>

#include "chorus/cuda/cudnn/cudnn_handle.h"

namespace chorus::cuda {

// A cuDNN backend descriptor (Owned: cuda/runtime/caches.h).
class BackendDesc {
 public:
  BackendDesc() = default;
  explicit BackendDesc(cudnnBackendDescriptorType_t type) {
    CHORUS_CUDNN_CHECK(cudnnBackendCreateDescriptor(type, owned_.out()));
  }

  cudnnBackendDescriptor_t get() const { return owned_.get(); }
  template <typename T>
  void set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count,
           const T* values) {
    CHORUS_CUDNN_CHECK(cudnnBackendSetAttribute(owned_.get(), name, type, count, values));
  }
  void set_desc(cudnnBackendAttributeName_t name, const BackendDesc& other) {
    cudnnBackendDescriptor_t o = other.get();
    set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &o);
  }
  void finalize() { CHORUS_CUDNN_CHECK(cudnnBackendFinalize(owned_.get())); }
  cudnnStatus_t try_finalize() { return cudnnBackendFinalize(owned_.get()); }

 private:
  Owned<cudnnBackendDescriptor_t, cudnnBackendDestroyDescriptor> owned_;
};

// The descriptors (of `type`, at most `max`) an attribute of `from` holds;
// empty when cuDNN refuses the read.
std::vector<BackendDesc> get_descriptors(const BackendDesc& from, cudnnBackendAttributeName_t name,
                                         cudnnBackendDescriptorType_t type, int64_t max);

// Engine configurations for `graph` from one heuristics mode, best first.
// An empty list when the mode has none (or cuDNN refuses the graph).
std::vector<BackendDesc> engine_configs(const BackendDesc& graph, cudnnBackendHeurMode_t mode);

}  // namespace chorus::cuda
