// Synthetic data: deterministic, the requested shapes and labels, noise of
// the requested size, and learnable: a nearest-class-mean classifier fitted
// on the train split classifies the test split well.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "chorus/core/error.h"
#include "chorus/data/synthetic.h"

namespace chorus::data {
namespace {

std::vector<float> image_of(const Dataset& d, int64_t i, int64_t* label = nullptr) {
  std::vector<float> v(static_cast<size_t>(d.image_numel()));
  int64_t l;
  d.get(i, v.data(), label ? label : &l);
  return v;
}

TEST(DataSynthetic, ShapesLabelsAndDeterminism) {
  SyntheticOptions o{.size = 50, .image_shape = {3, 8, 10}, .num_classes = 7, .seed = 3};
  auto a = make_synthetic(o), b = make_synthetic(o);
  EXPECT_EQ(a->size(), 50);
  EXPECT_EQ(a->image_shape(), (Shape{3, 8, 10}));
  EXPECT_EQ(a->num_classes(), 7);
  for (int64_t i = 0; i < 50; ++i) {
    int64_t la, lb;
    EXPECT_EQ(image_of(*a, i, &la), image_of(*b, i, &lb));
    EXPECT_EQ(la, i % 7);
    EXPECT_EQ(lb, la);
  }
  EXPECT_NE(image_of(*a, 0), image_of(*a, 7));  // same class, fresh noise
  o.seed = 4;
  EXPECT_NE(image_of(*a, 0), image_of(*make_synthetic(o), 0));
  o.train = false;
  o.seed = 3;
  EXPECT_NE(image_of(*a, 0), image_of(*make_synthetic(o), 0));
}

TEST(DataSynthetic, NoiseHasTheRequestedSpread) {
  // Two examples of one class differ only by noise: the difference has
  // variance 2 * noise_std^2.
  auto d = make_synthetic({.size = 200, .image_shape = {3, 32, 32}, .num_classes = 2, .noise_std = 0.5f});
  double sum2 = 0;
  int64_t n = 0;
  for (int64_t i = 0; i + 2 < 200; i += 2) {
    const std::vector<float> a = image_of(*d, i), b = image_of(*d, i + 2);
    for (size_t p = 0; p < a.size(); ++p, ++n) sum2 += (a[p] - b[p]) * (a[p] - b[p]);
  }
  EXPECT_NEAR(sum2 / n, 2 * 0.25, 0.01);
}

TEST(DataSynthetic, LearnableByNearestClassMean) {
  const SyntheticOptions train{.size = 300, .image_shape = {1, 28, 28}, .num_classes = 10, .seed = 1};
  SyntheticOptions test = train;
  test.size = 200;
  test.train = false;
  auto tr = make_synthetic(train), te = make_synthetic(test);
  const int64_t numel = tr->image_numel();
  std::vector<double> means(10 * numel, 0.0);
  for (int64_t i = 0; i < tr->size(); ++i) {
    int64_t label;
    const std::vector<float> x = image_of(*tr, i, &label);
    for (int64_t p = 0; p < numel; ++p) means[label * numel + p] += x[p] / 30.0;
  }
  int correct = 0;
  for (int64_t i = 0; i < te->size(); ++i) {
    int64_t label;
    const std::vector<float> x = image_of(*te, i, &label);
    int64_t best = -1;
    double best_d = std::numeric_limits<double>::max();
    for (int64_t c = 0; c < 10; ++c) {
      double dist = 0;
      for (int64_t p = 0; p < numel; ++p) dist += std::pow(x[p] - means[c * numel + p], 2);
      if (dist < best_d) best_d = dist, best = c;
    }
    correct += best == label;
  }
  EXPECT_GE(correct, 190) << "of 200";
}

TEST(DataSynthetic, RejectsBadOptions) {
  EXPECT_THROW(make_synthetic({.image_shape = {3, 32}}), ValueError);
  EXPECT_THROW(make_synthetic({.num_classes = 0}), ValueError);
  EXPECT_THROW(make_synthetic({.size = -1}), ValueError);
  auto d = make_synthetic({.size = 4});
  std::vector<float> v(d->image_numel());
  int64_t l;
  EXPECT_THROW(d->get(4, v.data(), &l), ValueError);
}

}  // namespace
}  // namespace chorus::data
