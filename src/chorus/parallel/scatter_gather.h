// Scatter and gather over nested values (a tensor, or lists and maps of them:
// nn::Value), as DataParallel splits its input and joins its outputs.
#pragma once

#include <vector>

#include "chorus/core/device.h"
#include "chorus/nn/value.h"

namespace chorus::parallel {

// Size along `dim` of the first tensor in `x`. Throws ValueError when `x`
// holds no tensor.
int64_t batch_size(const nn::Value& x, int64_t dim);

// Every tensor of `x` narrowed to [start, start + len) along `dim` and copied
// to `device` — straight from wherever it is (host memory or another device),
// asynchronously by the cross-device rule.
nn::Value scatter(const nn::Value& x, int64_t dim, int64_t start, int64_t len, const Device& device);

// The parts (one per replica, the same structure each) concatenated along
// `dim` on `device`; scalars gather as a vector.
nn::Value gather(const std::vector<nn::Value>& parts, int64_t dim, const Device& device);

}  // namespace chorus::parallel
