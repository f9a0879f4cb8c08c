#include "chorus/data/synthetic.h"

#include <algorithm>
#include <cmath>

#include "chorus/core/error.h"
#include "chorus/data/random_streams.h"

namespace chorus::data {

namespace {

constexpr int64_t kMaxGrid = 4;

// Vigna's SplitMix64: one 64-bit output per call, advancing `state`.
uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

SyntheticDataset::SyntheticDataset(SyntheticOptions options) : options_(std::move(options)) {
  const Shape& s = options_.image_shape;
  CHORUS_CHECK(options_.size >= 0, "synthetic data: size must be >= 0, got ", options_.size);
  CHORUS_CHECK(s.size() == 3 && s[0] > 0 && s[1] > 0 && s[2] > 0,
               "synthetic data: image_shape must be a positive [C, H, W], got ", shape_str(s));
  CHORUS_CHECK(options_.num_classes >= 1, "synthetic data: num_classes must be >= 1, got ",
               options_.num_classes);
  CHORUS_CHECK(options_.noise_std >= 0, "synthetic data: noise_std must be >= 0, got ",
               options_.noise_std);
  grid_h_ = std::min(s[1], kMaxGrid);
  grid_w_ = std::min(s[2], kMaxGrid);
  const int64_t n = options_.num_classes * s[0] * grid_h_ * grid_w_;
  patterns_.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const philox::U4 r = detail::random4(options_.seed, detail::Stream::kSyntheticPattern,
                                         static_cast<uint64_t>(i), 0);
    patterns_[i] = 2.0f * philox::to_unit(r.x) - 1.0f;
  }
}

std::string SyntheticDataset::name() const {
  return "synthetic " + std::string(options_.train ? "train" : "test") + " (" +
         std::to_string(options_.size) + " x " + shape_str(options_.image_shape) + ", " +
         std::to_string(options_.num_classes) + " classes, seed " + std::to_string(options_.seed) + ")";
}

void SyntheticDataset::get(int64_t index, float* image_out, int64_t* label_out) const {
  check_index(index);
  const int64_t c = options_.image_shape[0], h = options_.image_shape[1], w = options_.image_shape[2];
  const int64_t label = index % options_.num_classes;
  // Uniform on [-a, a] has standard deviation a / sqrt(3).
  const float amp = options_.noise_std * std::sqrt(3.0f);
  const uint64_t split = options_.train ? 0 : 1;
  const float* pattern = &patterns_[label * c * grid_h_ * grid_w_];
  // Philox gives the example's noise stream a 64-bit starting point keyed by
  // (seed, split, index); SplitMix64 then draws two pixels per step. That
  // keeps get() a pure function of the index, and much cheaper than a Philox
  // block per four pixels: benchmarks feed GPUs from it.
  const philox::U4 r = detail::random4(options_.seed, detail::Stream::kSyntheticNoise,
                                       static_cast<uint64_t>(index), split);
  uint64_t state = (uint64_t{r.x} << 32) | r.y;
  uint64_t bits = 0;
  int64_t p = 0;
  for (int64_t ch = 0; ch < c; ++ch) {
    for (int64_t y = 0; y < h; ++y) {
      const float* prow = pattern + (ch * grid_h_ + y * grid_h_ / h) * grid_w_;
      for (int64_t x = 0; x < w; ++x, ++p) {
        if (p % 2 == 0) bits = splitmix64(state);
        const auto word = static_cast<uint32_t>(p % 2 == 0 ? bits : bits >> 32);
        image_out[p] = prow[x * grid_w_ / w] + amp * (2.0f * philox::to_unit(word) - 1.0f);
      }
    }
  }
  *label_out = label;
}

std::shared_ptr<Dataset> make_synthetic(SyntheticOptions options) {
  return std::make_shared<SyntheticDataset>(std::move(options));
}

}  // namespace chorus::data
