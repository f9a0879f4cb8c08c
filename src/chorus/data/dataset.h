// Dataset: random access to normalised examples, the interface every data
// source (IDX files, CIFAR-10 binaries, synthetic images) implements and the
// DataLoader consumes.
//
// Design: a dataset hands out one example at a time into memory the caller
// owns (a row of the batch tensor being assembled), so the loader's worker
// threads fill a batch in place with no per-example tensors. get() is const
// and must be safe to call from several threads at once: datasets load (or
// define) everything in their constructor and never mutate afterwards.
// Randomness that changes per epoch (augmentation) is not the dataset's job;
// it lives in transforms.h, keyed by (seed, epoch, index).
#pragma once

#include <cstdint>
#include <string>

#include "chorus/core/shape.h"
#include "chorus/core/tensor.h"

namespace chorus::data {

// One batch as the training loop sees it.
struct Batch {
  Tensor images;  // float32 [B, C, H, W]
  Tensor labels;  // int64 [B]
};

class Dataset {
 public:
  virtual ~Dataset() = default;

  virtual int64_t size() const = 0;
  virtual Shape image_shape() const = 0;  // [C, H, W]
  virtual int64_t num_classes() const = 0;
  // Writes example `index`: numel(image_shape()) normalised floats in CHW
  // order to image_out, and its class to *label_out. Thread-safe.
  // Throws ValueError for an index outside [0, size()).
  virtual void get(int64_t index, float* image_out, int64_t* label_out) const = 0;
  // For logs and error messages, e.g. "cifar10 train (data/cifar10)".
  virtual std::string name() const = 0;

  int64_t image_numel() const { return numel_of(image_shape()); }

 protected:
  void check_index(int64_t index) const;
};

}  // namespace chorus::data
