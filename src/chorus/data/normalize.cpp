#include "chorus/data/normalize.h"

#include "chorus/core/error.h"

namespace chorus::data {

void Normalize::check(int64_t channels, const std::string& who) const {
  auto fits = [&](const std::vector<float>& v) {
    return v.empty() || v.size() == 1 || static_cast<int64_t>(v.size()) == channels;
  };
  CHORUS_CHECK(fits(mean) && fits(std), who, ": Normalize has ", mean.size(), " means and ",
               std.size(), " stds; expected 0, 1 or ", channels, " (one per channel)");
  for (float s : std) CHORUS_CHECK(s > 0, who, ": Normalize std must be > 0, got ", s);
}

PixelTable::PixelTable(const Normalize& n, int64_t channels, const std::string& who)
    : channels_(channels), table_(static_cast<size_t>(channels) * 256) {
  n.check(channels, who);
  auto pick = [](const std::vector<float>& v, int64_t c, float dflt) {
    return v.empty() ? dflt : v.size() == 1 ? v[0] : v[c];
  };
  for (int64_t c = 0; c < channels; ++c) {
    // Computed in double, rounded once, so the table equals the formula.
    const double m = pick(n.mean, c, 0.0f), s = pick(n.std, c, 1.0f);
    for (int p = 0; p < 256; ++p)
      table_[c * 256 + p] = static_cast<float>((p / 255.0 - m) / s);
  }
}

void PixelTable::convert(const uint8_t* pixels, int64_t plane, float* out) const {
  for (int64_t c = 0; c < channels_; ++c) {
    const float* t = &table_[c * 256];
    const uint8_t* src = pixels + c * plane;
    float* dst = out + c * plane;
    for (int64_t i = 0; i < plane; ++i) dst[i] = t[src[i]];
  }
}

}  // namespace chorus::data
