#include "chorus/data/transforms.h"

#include <algorithm>
#include <cstring>

#include "chorus/core/error.h"
#include "chorus/data/random_streams.h"

namespace chorus::data {

philox::U4 RandomKey::words() const {
  return detail::random4(seed, static_cast<uint64_t>(detail::Stream::kTransform) + slot,
                         static_cast<uint64_t>(index), static_cast<uint64_t>(epoch));
}

namespace {
void check_chw(const Shape& s, const std::string& who) {
  CHORUS_CHECK(s.size() == 3, who, ": expected a [C, H, W] image shape, got ", shape_str(s));
}
}  // namespace

// ---- RandomCrop ----------------------------------------------------------------

RandomCrop::RandomCrop(int64_t size, int64_t padding, float fill)
    : size_(size), padding_(padding), fill_(fill) {
  CHORUS_CHECK(size > 0, "RandomCrop: size must be > 0, got ", size);
  CHORUS_CHECK(padding >= 0, "RandomCrop: padding must be >= 0, got ", padding);
}

std::string RandomCrop::name() const {
  return "RandomCrop(" + std::to_string(size_) + ", padding=" + std::to_string(padding_) + ")";
}

Shape RandomCrop::output_shape(const Shape& in) const {
  check_chw(in, name());
  CHORUS_CHECK(size_ <= in[1] + 2 * padding_ && size_ <= in[2] + 2 * padding_, name(),
               ": crop larger than the padded image ", shape_str(in));
  return {in[0], size_, size_};
}

void RandomCrop::apply(const float* in, const Shape& in_shape, float* out,
                       const RandomKey& key) const {
  const int64_t c = in_shape[0], h = in_shape[1], w = in_shape[2];
  const philox::U4 r = key.words();
  // Window origin in padded coordinates, uniform over the valid positions.
  const auto top = static_cast<int64_t>(detail::below(r.x, r.y, h + 2 * padding_ - size_ + 1));
  const auto left = static_cast<int64_t>(detail::below(r.z, r.w, w + 2 * padding_ - size_ + 1));
  const int64_t y0 = top - padding_, x0 = left - padding_;  // in source coordinates
  // Source columns [xs, xe) land inside the window; the rest is fill.
  const int64_t xs = std::max<int64_t>(x0, 0), xe = std::min<int64_t>(x0 + size_, w);
  for (int64_t ch = 0; ch < c; ++ch) {
    for (int64_t y = 0; y < size_; ++y) {
      float* row = out + (ch * size_ + y) * size_;
      const int64_t sy = y0 + y;
      if (sy < 0 || sy >= h || xs >= xe) {
        std::fill(row, row + size_, fill_);
        continue;
      }
      std::fill(row, row + (xs - x0), fill_);
      std::memcpy(row + (xs - x0), in + (ch * h + sy) * w + xs, sizeof(float) * (xe - xs));
      std::fill(row + (xe - x0), row + size_, fill_);
    }
  }
}

// ---- RandomHorizontalFlip --------------------------------------------------------

RandomHorizontalFlip::RandomHorizontalFlip(double p) : p_(p) {
  CHORUS_CHECK(p >= 0 && p <= 1, "RandomHorizontalFlip: p must be in [0, 1], got ", p);
}

std::string RandomHorizontalFlip::name() const {
  return "RandomHorizontalFlip(p=" + std::to_string(p_) + ")";
}

void RandomHorizontalFlip::apply(const float* in, const Shape& in_shape, float* out,
                                 const RandomKey& key) const {
  check_chw(in_shape, name());
  const int64_t rows = in_shape[0] * in_shape[1], w = in_shape[2];
  const bool flip = philox::to_unit(key.words().x) < p_;
  if (!flip) {
    std::memcpy(out, in, sizeof(float) * rows * w);
    return;
  }
  for (int64_t r = 0; r < rows; ++r)
    std::reverse_copy(in + r * w, in + (r + 1) * w, out + r * w);
}

// ---- Compose ---------------------------------------------------------------------

Compose::Compose(std::vector<std::shared_ptr<const Transform>> transforms)
    : transforms_(std::move(transforms)) {
  for (const auto& t : transforms_) CHORUS_CHECK(t != nullptr, "Compose: null transform");
}

std::string Compose::name() const {
  std::string s = "Compose(";
  for (size_t i = 0; i < transforms_.size(); ++i) s += (i ? ", " : "") + transforms_[i]->name();
  return s + ")";
}

Shape Compose::output_shape(const Shape& in) const {
  Shape s = in;
  for (const auto& t : transforms_) s = t->output_shape(s);
  return s;
}

void Compose::apply(const float* in, const Shape& in_shape, float* out,
                    const RandomKey& key) const {
  if (transforms_.empty()) {
    std::memcpy(out, in, sizeof(float) * numel_of(in_shape));
    return;
  }
  // Ping-pong between two scratch images; the last step writes to `out`.
  // thread_local because each loader worker calls this once per example.
  thread_local std::vector<float> a, b;
  const float* src = in;
  Shape shape = in_shape;
  for (size_t i = 0; i < transforms_.size(); ++i) {
    const Shape next = transforms_[i]->output_shape(shape);
    float* dst = out;
    if (i + 1 < transforms_.size()) {
      std::vector<float>& buf = (src == a.data()) ? b : a;
      buf.resize(static_cast<size_t>(numel_of(next)));
      dst = buf.data();
    }
    RandomKey k = key;
    k.slot = key.slot + static_cast<int64_t>(i);
    transforms_[i]->apply(src, shape, dst, k);
    src = dst;
    shape = next;
  }
}

}  // namespace chorus::data
