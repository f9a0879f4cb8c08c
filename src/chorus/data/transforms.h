// Per-example random augmentation: random crop with padding and random
// horizontal flip, applied by the DataLoader's workers to normalised images.
//
// Reproducibility: a transform never owns a generator. It draws from the
// RandomKey it is handed, four Philox words determined by (loader seed,
// epoch, dataset index, position in the pipeline). So example i is
// augmented the same way in epoch e whatever the worker count, whichever
// thread builds its batch and whether the run resumed from a checkpoint,
// and differently in every epoch.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "chorus/core/philox.h"
#include "chorus/core/shape.h"

namespace chorus::data {

struct RandomKey {
  uint64_t seed = 0;
  int64_t epoch = 0;
  int64_t index = 0;  // the example's dataset index
  int64_t slot = 0;   // the transform's position in its pipeline
  philox::U4 words() const;
};

class Transform {
 public:
  virtual ~Transform() = default;
  // The [C, H, W] this transform produces from `in`; throws ValueError when
  // it cannot apply to `in`.
  virtual Shape output_shape(const Shape& in) const { return in; }
  // Writes the transformed CHW image to `out` (numel(output_shape(in))
  // floats). `in` and `out` do not overlap.
  virtual void apply(const float* in, const Shape& in_shape, float* out,
                     const RandomKey& key) const = 0;
  virtual std::string name() const = 0;
};

// Pads H and W by `padding` on each side with `fill` (0 in normalised space
// is the data set's mean), then cuts a random size x size window: for
// CIFAR-10, RandomCrop(32, 4) as in torchvision.
class RandomCrop : public Transform {
 public:
  explicit RandomCrop(int64_t size, int64_t padding = 0, float fill = 0.0f);
  Shape output_shape(const Shape& in) const override;
  void apply(const float* in, const Shape& in_shape, float* out, const RandomKey& key) const override;
  std::string name() const override;

 private:
  int64_t size_, padding_;
  float fill_;
};

// Mirrors the image left-right with probability p.
class RandomHorizontalFlip : public Transform {
 public:
  explicit RandomHorizontalFlip(double p = 0.5);
  void apply(const float* in, const Shape& in_shape, float* out, const RandomKey& key) const override;
  std::string name() const override;

 private:
  double p_;
};

// Several transforms in order; transform i draws with slot i.
class Compose : public Transform {
 public:
  explicit Compose(std::vector<std::shared_ptr<const Transform>> transforms);
  Shape output_shape(const Shape& in) const override;
  void apply(const float* in, const Shape& in_shape, float* out, const RandomKey& key) const override;
  std::string name() const override;
  bool empty() const { return transforms_.empty(); }

 private:
  std::vector<std::shared_ptr<const Transform>> transforms_;
};

}  // namespace chorus::data
