// cuDNN's backend (graph) API, the pieces its users share: an owned
// descriptor, reading descriptor lists back, and the heuristics' engine
// configurations for an operation graph. Used by the convolution plans
// (conv_plan.cpp) and the fused attention (flash_attention.cpp). Include only
// from src/chorus/cuda.
#pragma once

#include <memory>
#include <string>
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

// "engine 12 knobs 1=3 4=0": an engine configuration's engine (its global
// index) and knob choices (type=value), for logs and for telling
// configurations apart ("engine ?" when cuDNN will not say).
std::string describe_engine_config(const BackendDesc& cfg);

// Configurations beside `cfg` (Note [Attention plan search] in
// flash_attention.cpp): its engine with one knob moved to each other value the
// engine declares for it (the other knobs as in `cfg`), knob by knob, at most
// `max` of them; those cuDNN will not finalise are left out. Which of them
// make an execution plan for the graph is for the caller to find out.
struct KnobNeighbours {
  std::shared_ptr<BackendDesc> engine;  // the configurations refer to it: keep it until their plans are final
  std::vector<BackendDesc> configs;
};
KnobNeighbours knob_neighbours(const BackendDesc& graph, const BackendDesc& cfg, int64_t max);

}  // namespace chorus::cuda
