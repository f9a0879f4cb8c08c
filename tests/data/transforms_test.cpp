// Augmentation: random crop and flip checked against a naive reference
// (pad the image, then find the window), shapes, reproducibility from the
// key alone, and variation across epochs and examples.
#include <gtest/gtest.h>

#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "chorus/core/error.h"
#include "chorus/core/philox.h"
#include "chorus/data/transforms.h"

namespace chorus::data {
namespace {

std::vector<float> random_image(const Shape& s, uint64_t seed) {
  std::vector<float> v(static_cast<size_t>(numel_of(s)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = 2.0f * philox::uniform(seed, 0, i) - 1.0f;
  return v;
}

std::vector<float> run(const Transform& t, const std::vector<float>& in, const Shape& s,
                       const RandomKey& key) {
  std::vector<float> out(static_cast<size_t>(numel_of(t.output_shape(s))), -99.0f);
  t.apply(in.data(), s, out.data(), key);
  return out;
}

// The (top, left) of the window of the zero-padded image that `out` is, or
// (-1, -1) if it is none of them. Found by brute force over all windows.
std::pair<int64_t, int64_t> find_window(const std::vector<float>& in, const Shape& s, int64_t pad,
                                        int64_t size, const std::vector<float>& out) {
  const int64_t c = s[0], h = s[1], w = s[2];
  auto padded = [&](int64_t ch, int64_t y, int64_t x) {
    y -= pad;
    x -= pad;
    return (y < 0 || y >= h || x < 0 || x >= w) ? 0.0f : in[(ch * h + y) * w + x];
  };
  for (int64_t top = 0; top + size <= h + 2 * pad; ++top)
    for (int64_t left = 0; left + size <= w + 2 * pad; ++left) {
      bool match = true;
      for (int64_t ch = 0; ch < c && match; ++ch)
        for (int64_t y = 0; y < size && match; ++y)
          for (int64_t x = 0; x < size && match; ++x)
            match = out[(ch * size + y) * size + x] == padded(ch, top + y, left + x);
      if (match) return {top, left};
    }
  return {-1, -1};
}

TEST(DataTransforms, CropShapes) {
  EXPECT_EQ(RandomCrop(32, 4).output_shape({3, 32, 32}), (Shape{3, 32, 32}));
  EXPECT_EQ(RandomCrop(24).output_shape({3, 32, 30}), (Shape{3, 24, 24}));
  EXPECT_THROW(RandomCrop(40, 2).output_shape({3, 32, 32}), ValueError);
  EXPECT_THROW(RandomCrop(4).output_shape({32, 32}), ValueError);
  EXPECT_THROW(RandomCrop(0), ValueError);
  EXPECT_THROW(RandomCrop(8, -1), ValueError);
  EXPECT_EQ(RandomHorizontalFlip().output_shape({1, 28, 28}), (Shape{1, 28, 28}));
}

TEST(DataTransforms, CropIsAWindowOfThePaddedImageCoveringAllPositions) {
  const Shape s{3, 8, 6};
  RandomCrop crop(8, 2);  // 5 x 3 window positions
  std::set<std::pair<int64_t, int64_t>> positions;
  for (int64_t index = 0; index < 400; ++index) {
    const std::vector<float> in = random_image(s, index);
    const auto at = find_window(in, s, 2, 8, run(crop, in, s, {7, 0, index, 0}));
    ASSERT_NE(at.first, -1) << "example " << index << " is no window of the padded image";
    positions.insert(at);
  }
  EXPECT_EQ(positions.size(), 5u * 3u);  // top in [0, 4], left in [0, 2]
}

TEST(DataTransforms, CropFillValue) {
  const Shape s{1, 2, 2};
  const std::vector<float> in{1, 2, 3, 4};
  RandomCrop crop(2, 5, -7.0f);  // most windows lie wholly in the padding
  int all_fill = 0;
  for (int64_t index = 0; index < 50; ++index) {
    const std::vector<float> out = run(crop, in, s, {1, 0, index, 0});
    bool fill = true;
    for (float v : out) fill = fill && v == -7.0f;
    all_fill += fill;
  }
  EXPECT_GT(all_fill, 20);
}

TEST(DataTransforms, FlipIsIdentityOrMirror) {
  const Shape s{2, 3, 5};
  const std::vector<float> in = random_image(s, 1);
  std::vector<float> mirror(in.size());
  for (int64_t r = 0; r < 6; ++r)
    for (int64_t x = 0; x < 5; ++x) mirror[r * 5 + x] = in[r * 5 + (4 - x)];
  int flipped = 0;
  const int n = 2000;
  for (int64_t index = 0; index < n; ++index) {
    const std::vector<float> out = run(RandomHorizontalFlip(), in, s, {3, 1, index, 0});
    ASSERT_TRUE(out == in || out == mirror) << "example " << index;
    flipped += out == mirror;
  }
  EXPECT_NEAR(flipped, n / 2, 5 * 23);  // binomial sd = sqrt(2000 / 4) ~ 22
  EXPECT_EQ(run(RandomHorizontalFlip(0.0), in, s, {3, 1, 5, 0}), in);
  EXPECT_EQ(run(RandomHorizontalFlip(1.0), in, s, {3, 1, 5, 0}), mirror);
}

TEST(DataTransforms, ReproducibleFromTheKeyAndVaryingAcrossEpochs) {
  const Shape s{3, 32, 32};
  const std::vector<float> in = random_image(s, 2);
  Compose t({std::make_shared<RandomCrop>(32, 4), std::make_shared<RandomHorizontalFlip>()});
  EXPECT_EQ(t.output_shape(s), s);
  int differ_by_epoch = 0, differ_by_seed = 0;
  for (int64_t index = 0; index < 20; ++index) {
    const std::vector<float> a = run(t, in, s, {11, 3, index, 0});
    EXPECT_EQ(a, run(t, in, s, {11, 3, index, 0}));
    differ_by_epoch += a != run(t, in, s, {11, 4, index, 0});
    differ_by_seed += a != run(t, in, s, {12, 3, index, 0});
  }
  EXPECT_GE(differ_by_epoch, 15);
  EXPECT_GE(differ_by_seed, 15);
}

// Compose gives transform i the key's slot + i: the same as applying the
// transforms one by one with those slots.
TEST(DataTransforms, ComposeMatchesStepByStep) {
  const Shape s{3, 10, 12};
  const std::vector<float> in = random_image(s, 3);
  auto crop = std::make_shared<RandomCrop>(8, 1);
  auto flip = std::make_shared<RandomHorizontalFlip>();
  Compose t({crop, flip, crop});
  EXPECT_EQ(t.output_shape(s), (Shape{3, 8, 8}));
  for (int64_t index = 0; index < 10; ++index) {
    const std::vector<float> a = run(*crop, in, s, {5, 2, index, 0});
    const std::vector<float> b = run(*flip, a, {3, 8, 8}, {5, 2, index, 1});
    const std::vector<float> c = run(*crop, b, {3, 8, 8}, {5, 2, index, 2});
    EXPECT_EQ(run(t, in, s, {5, 2, index, 0}), c);
  }
  EXPECT_EQ(run(Compose({}), in, s, {}), in);
}

}  // namespace
}  // namespace chorus::data
