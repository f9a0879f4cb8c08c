// CIFAR-10 from its binary distribution (cifar-10-binary.tar.gz).
//
// Files: data_batch_1.bin .. data_batch_5.bin (train) and test_batch.bin,
// each a run of 3073-byte records: 1 label byte (0-9), then 3072 pixel bytes,
// the red, green and blue 32x32 planes in turn (already CHW). They are found
// in `dir` or in `dir/cifar-10-batches-bin/`, the folder the archive unpacks
// to. The records are kept in memory as read (uint8, 154 MB for the training
// set) and normalised in get(). A file may hold any whole number of records,
// so tests can write small ones; the real files hold 10000.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "chorus/data/dataset.h"
#include "chorus/data/normalize.h"

namespace chorus::data {

inline constexpr int64_t kCifarRecordBytes = 1 + 3 * 32 * 32;

class Cifar10Dataset : public Dataset {
 public:
  Cifar10Dataset(const std::string& dir, bool train, Normalize normalize = Normalize::cifar10());

  int64_t size() const override { return count_; }
  Shape image_shape() const override { return {3, 32, 32}; }
  int64_t num_classes() const override { return 10; }
  void get(int64_t index, float* image_out, int64_t* label_out) const override;
  std::string name() const override { return name_; }

  // The stored example, before normalisation (3072 bytes, CHW).
  const uint8_t* pixels(int64_t index) const;
  int64_t label(int64_t index) const;

 private:
  std::string name_;
  int64_t count_ = 0;
  std::vector<uint8_t> records_;  // the files' records, concatenated
  PixelTable table_;
};

std::shared_ptr<Dataset> load_cifar10(const std::string& dir, bool train,
                                      Normalize normalize = Normalize::cifar10());

}  // namespace chorus::data
