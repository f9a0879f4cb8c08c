// MNIST and Fashion-MNIST from IDX files.
//
// The four files of a data set, gzip-compressed or not, are looked up as
//   <dir>/train-images-idx3-ubyte[.gz]  <dir>/train-labels-idx1-ubyte[.gz]
//   <dir>/t10k-images-idx3-ubyte[.gz]   <dir>/t10k-labels-idx1-ubyte[.gz]
// (the names LeCun's and Zalando's downloads use; Debian's
// dataset-fashion-mnist installs the .gz ones under kFashionMnistDir).
// Pixels stay uint8 in memory (47 MB for the 60000 training images) and are
// normalised in get(). Every malformed-file error is an IOError naming the
// file, what was expected and what was found.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "chorus/data/dataset.h"
#include "chorus/data/normalize.h"

namespace chorus::data {

inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

// An IDX file of unsigned bytes: its dimensions and its payload (the bytes
// after the header), in file order.
struct IdxArray {
  std::vector<int64_t> dims;
  std::vector<uint8_t> bytes;
};

// Reads an unsigned-byte IDX file with `ndim` dimensions (magic number
// 0x0800 + ndim: 2051 for images, 2049 for labels), gzip or raw. Throws
// IOError naming `path` for a bad magic number, a short header, or a payload
// shorter than the dimensions say (with the byte offset where the file ends).
IdxArray read_idx_ubyte(const std::string& path, int ndim);

class MnistDataset : public Dataset {
 public:
  // Loads the training (60000) or test (10000) split from `dir`.
  MnistDataset(const std::string& dir, bool train, Normalize normalize = Normalize::fashion_mnist());

  int64_t size() const override { return count_; }
  Shape image_shape() const override { return {1, rows_, cols_}; }
  int64_t num_classes() const override { return 10; }
  void get(int64_t index, float* image_out, int64_t* label_out) const override;
  std::string name() const override { return name_; }

  // The stored example, before normalisation.
  const uint8_t* pixels(int64_t index) const;
  int64_t label(int64_t index) const;

 private:
  std::string name_;
  int64_t count_ = 0, rows_ = 0, cols_ = 0;
  std::vector<uint8_t> images_;  // [count, rows, cols]
  std::vector<uint8_t> labels_;  // [count]
  PixelTable table_;
};

std::shared_ptr<Dataset> load_mnist(const std::string& dir, bool train,
                                    Normalize normalize = Normalize::fashion_mnist());

}  // namespace chorus::data
