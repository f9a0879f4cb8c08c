// Normalize: the per-channel (x - mean) / std that turns 8-bit pixels into the
// float inputs a network trains on, with the published statistics of each
// data set as named constructors.
//
// Why a value type and not a transform: every file-backed dataset stores
// uint8 pixels (4x less memory than floats) and converts in get(). A pixel has
// only 256 values, so the conversion is a table lookup per channel
// (PixelTable), exact and cheaper than the arithmetic. Random augmentation
// (transforms.h) then runs on the normalised floats, so its zero padding is
// the data set's mean, as in most C++ training code.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace chorus::data {

struct Normalize {
  // One value per channel, or a single value for all channels. Empty mean is
  // 0 and empty std is 1, so Normalize{} maps a pixel p to p / 255.
  std::vector<float> mean;
  std::vector<float> std;

  static Normalize identity() { return {}; }
  static Normalize mnist() { return {{0.1307f}, {0.3081f}}; }
  static Normalize fashion_mnist() { return {{0.2860f}, {0.3530f}}; }
  static Normalize cifar10() { return {{0.4914f, 0.4822f, 0.4465f}, {0.2470f, 0.2435f, 0.2616f}}; }

  // Throws ValueError if the sizes do not fit `channels` or a std is not > 0.
  void check(int64_t channels, const std::string& who) const;
};

// value = table[c * 256 + p] = (p / 255 - mean[c]) / std[c].
class PixelTable {
 public:
  PixelTable(const Normalize& n, int64_t channels, const std::string& who);
  // Converts one CHW image of `plane` pixels per channel.
  void convert(const uint8_t* pixels, int64_t plane, float* out) const;

 private:
  int64_t channels_;
  std::vector<float> table_;
};

}  // namespace chorus::data
