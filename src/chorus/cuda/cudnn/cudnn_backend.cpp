// cuDNN backend-API helpers shared by the graph users (cudnn_backend.h).
#include "chorus/cuda/cudnn/cudnn_backend.h"

#include <algorithm>

namespace chorus::cuda {

std::vector<BackendDesc> get_descriptors(const BackendDesc& from, cudnnBackendAttributeName_t name,
                                         cudnnBackendDescriptorType_t type, int64_t max) {
  std::vector<BackendDesc> descs;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < max; ++i) {
    descs.emplace_back(type);
    raw.push_back(descs.back().get());
  }
  int64_t got = 0;
  if (cudnnBackendGetAttribute(from.get(), name, CUDNN_TYPE_BACKEND_DESCRIPTOR, max, &got, raw.data()) !=
      CUDNN_STATUS_SUCCESS)
    return {};
  descs.resize(static_cast<size_t>(std::clamp<int64_t>(got, 0, max)));
  return descs;
}

std::vector<BackendDesc> engine_configs(const BackendDesc& graph, cudnnBackendHeurMode_t mode) {
  std::vector<BackendDesc> out;
  BackendDesc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
  heur.set_desc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph);
  heur.set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
  if (heur.try_finalize() != CUDNN_STATUS_SUCCESS) return out;
  int64_t count = 0;
  if (cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count,
                               nullptr) != CUDNN_STATUS_SUCCESS ||
      count <= 0)
    return out;
  return get_descriptors(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, count);
}

}  // namespace chorus::cuda
