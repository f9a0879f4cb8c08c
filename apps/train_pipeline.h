// `--strategy pipeline` for `chorus train` and `chorus bench`: the model laid
// out flat (models::as_sequential), split into stages by --balance or by
// measured time, and wrapped in a parallel::Pipeline.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "chorus/core/tensor.h"
#include "chorus/nn/module.h"
#include "chorus/parallel/pipeline.h"

namespace chorus::app {

// "14,15" -> {14, 15}; "time" or "memory" (measured later) -> {}; ValueError naming the bad part.
std::vector<int64_t> parse_balance(const std::string& text);

struct PipelineChoice {
  int64_t micro_batches = 4;
  std::string schedule = "1f1b";
  std::optional<std::string> balance;  // "14,15", "time" or "memory" (unset: time) measured on `sample`
  std::string recompute = "never";
  int64_t virtual_stages = 0;          // 0: the pipeline's default
  bool deferred_batch_norm = true;     // running statistics as on whole batches
  bool measure = false;
};

// The model (already on devices[0]) as a pipeline over `devices`. Without a
// balance, each layer is timed on `sample` (one micro-batch) on devices[0]
// and the stages get equal time (parallel::balance_by_time). `describe`, when
// given, receives a line saying how the model was split.
std::shared_ptr<parallel::Pipeline> make_pipeline(const nn::ModulePtr& model, const std::vector<Device>& devices,
                                                  const PipelineChoice& choice, const Tensor& sample,
                                                  std::string* describe = nullptr);

}  // namespace chorus::app
