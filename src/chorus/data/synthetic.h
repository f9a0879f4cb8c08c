// Synthetic images for benchmarks and smoke tests: no files, any size and
// shape, deterministic, and learnable.
//
// Example i has label i % num_classes. Its image is the class's mean pattern
// plus independent noise. A pattern is a coarse grid (up to 4 x 4 cells per
// channel) of values uniform in [-1, 1], drawn from Philox under `seed` and
// blown up to H x W, so it has the low-frequency structure both an MLP and a
// CNN pick up within a few steps; the noise (uniform, standard deviation
// noise_std) comes from a stream keyed by Philox under (seed, split, index).
// The train and test splits of one seed share their patterns and differ in
// their noise, so test accuracy measures generalisation. get() computes the pixels on the
// fly: no memory per example, a few ns per pixel.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "chorus/data/dataset.h"

namespace chorus::data {

struct SyntheticOptions {
  int64_t size = 1024;
  Shape image_shape{3, 32, 32};  // [C, H, W]
  int64_t num_classes = 10;
  uint64_t seed = 0;
  bool train = true;
  float noise_std = 1.0f;
};

class SyntheticDataset : public Dataset {
 public:
  explicit SyntheticDataset(SyntheticOptions options);

  int64_t size() const override { return options_.size; }
  Shape image_shape() const override { return options_.image_shape; }
  int64_t num_classes() const override { return options_.num_classes; }
  void get(int64_t index, float* image_out, int64_t* label_out) const override;
  std::string name() const override;

 private:
  SyntheticOptions options_;
  int64_t grid_h_, grid_w_;
  std::vector<float> patterns_;  // [classes, C, grid_h, grid_w]
};

std::shared_ptr<Dataset> make_synthetic(SyntheticOptions options);

}  // namespace chorus::data
