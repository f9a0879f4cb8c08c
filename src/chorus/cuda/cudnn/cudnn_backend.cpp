// cuDNN backend-API helpers shared by the graph users (cudnn_backend.h).
#include "chorus/cuda/cudnn/cudnn_backend.h"

#include <algorithm>
#include <utility>

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

namespace {

// The (type, value) pairs of a configuration's knob choices.
std::vector<std::pair<cudnnBackendKnobType_t, int64_t>> knob_choices(const BackendDesc& cfg) {
  std::vector<std::pair<cudnnBackendKnobType_t, int64_t>> out;
  for (const BackendDesc& knob :
       get_descriptors(cfg, CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR, CUDNN_KNOB_TYPE_COUNTS)) {
    cudnnBackendKnobType_t type{};
    int64_t got = 0, value = 0;
    if (cudnnBackendGetAttribute(knob.get(), CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE, CUDNN_TYPE_KNOB_TYPE, 1, &got, &type) ==
            CUDNN_STATUS_SUCCESS &&
        cudnnBackendGetAttribute(knob.get(), CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, CUDNN_TYPE_INT64, 1, &got, &value) ==
            CUDNN_STATUS_SUCCESS)
      out.emplace_back(type, value);
  }
  return out;
}

// The global index of a configuration's engine; -1 when cuDNN will not say.
int64_t engine_index(const BackendDesc& cfg) {
  BackendDesc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
  cudnnBackendDescriptor_t e = engine.get();
  int64_t got = 0, index = -1;
  if (cudnnBackendGetAttribute(cfg.get(), CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &got, &e) !=
          CUDNN_STATUS_SUCCESS ||
      cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &got, &index) !=
          CUDNN_STATUS_SUCCESS)
    return -1;
  return index;
}

}  // namespace

std::string describe_engine_config(const BackendDesc& cfg) {
  const int64_t index = engine_index(cfg);
  std::string out = index < 0 ? "engine ?" : "engine " + std::to_string(index);
  out += " knobs";
  for (const auto& [type, value] : knob_choices(cfg))
    out += " " + std::to_string(static_cast<int>(type)) + "=" + std::to_string(value);
  return out;
}

KnobNeighbours knob_neighbours(const BackendDesc& graph, const BackendDesc& cfg, int64_t max) {
  KnobNeighbours out;
  const int64_t index = engine_index(cfg);
  if (index < 0 || max <= 0) return out;
  // A fresh engine of the same index over the graph (as cudnn-frontend's
  // EngineBuilder makes one), for its knob ranges and the new configurations.
  auto engine = std::make_shared<BackendDesc>(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
  engine->set_desc(CUDNN_ATTR_ENGINE_OPERATION_GRAPH, graph);
  engine->set(CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &index);
  if (engine->try_finalize() != CUDNN_STATUS_SUCCESS) return out;
  out.engine = engine;
  const auto chosen = knob_choices(cfg);
  for (const BackendDesc& info :
       get_descriptors(*engine, CUDNN_ATTR_ENGINE_KNOB_INFO, CUDNN_BACKEND_KNOB_INFO_DESCRIPTOR, CUDNN_KNOB_TYPE_COUNTS)) {
    cudnnBackendKnobType_t type{};
    int64_t got = 0, lo = 0, hi = 0, stride = 0;
    if (cudnnBackendGetAttribute(info.get(), CUDNN_ATTR_KNOB_INFO_TYPE, CUDNN_TYPE_KNOB_TYPE, 1, &got, &type) !=
            CUDNN_STATUS_SUCCESS ||
        cudnnBackendGetAttribute(info.get(), CUDNN_ATTR_KNOB_INFO_MINIMUM_VALUE, CUDNN_TYPE_INT64, 1, &got, &lo) !=
            CUDNN_STATUS_SUCCESS ||
        cudnnBackendGetAttribute(info.get(), CUDNN_ATTR_KNOB_INFO_MAXIMUM_VALUE, CUDNN_TYPE_INT64, 1, &got, &hi) !=
            CUDNN_STATUS_SUCCESS ||
        cudnnBackendGetAttribute(info.get(), CUDNN_ATTR_KNOB_INFO_STRIDE, CUDNN_TYPE_INT64, 1, &got, &stride) !=
            CUDNN_STATUS_SUCCESS ||
        stride <= 0 || hi < lo)
      continue;
    int64_t current = lo;
    for (const auto& [t, v] : chosen)
      if (t == type) current = v;
    for (int64_t value = lo; value <= hi; value += stride) {
      if (value == current) continue;
      // The knob choices: cfg's, with this knob's value replaced (or added).
      std::vector<BackendDesc> knobs;
      bool placed = false;
      for (const auto& [t, v] : chosen) {
        BackendDesc& k = knobs.emplace_back(CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR);
        const int64_t val = t == type ? value : v;
        placed |= t == type;
        k.set(CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE, CUDNN_TYPE_KNOB_TYPE, 1, &t);
        k.set(CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, CUDNN_TYPE_INT64, 1, &val);
      }
      if (!placed) {
        BackendDesc& k = knobs.emplace_back(CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR);
        k.set(CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE, CUDNN_TYPE_KNOB_TYPE, 1, &type);
        k.set(CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, CUDNN_TYPE_INT64, 1, &value);
      }
      std::vector<cudnnBackendDescriptor_t> raw;
      bool ok = true;
      for (BackendDesc& k : knobs) {
        ok &= k.try_finalize() == CUDNN_STATUS_SUCCESS;
        raw.push_back(k.get());
      }
      if (!ok) continue;
      BackendDesc next(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
      next.set_desc(CUDNN_ATTR_ENGINECFG_ENGINE, *engine);
      next.set(CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<int64_t>(raw.size()),
               raw.data());
      if (next.try_finalize() != CUDNN_STATUS_SUCCESS) continue;
      out.configs.push_back(std::move(next));
      if (static_cast<int64_t>(out.configs.size()) >= max) return out;
    }
  }
  return out;
}

}  // namespace chorus::cuda
