// The Philox counter-based generator: the same seed gives the same numbers,
// element i depends only on (seed, counter offset, i) — not on threads, on
// devices, or on how a tensor is split into several draws.
#include <gtest/gtest.h>

#include <chorus/chorus.h>
#include <chorus/core/philox.h>

#include <cmath>
#include <set>

namespace chorus {
namespace {

// Philox4x32-10 known-answer vectors from the Random123 distribution
// (kat_vectors: philox4x32 10 rounds). Counter words (c0..c3), key (k0, k1).
TEST(Philox, KnownAnswerVectors) {
  // All zeros.
  philox::U4 z = philox::philox4x32(0, 0, 0);
  EXPECT_EQ(z.x, 0x6627e8d5u);
  EXPECT_EQ(z.y, 0xe169c58du);
  EXPECT_EQ(z.z, 0xbc57ac4cu);
  EXPECT_EQ(z.w, 0x9b00dbd8u);
  // All ones.
  philox::U4 o = philox::philox4x32(0xffffffffffffffffull, 0xffffffffffffffffull, 0xffffffffffffffffull);
  EXPECT_EQ(o.x, 0x408f276du);
  EXPECT_EQ(o.y, 0x41c83b0eu);
  EXPECT_EQ(o.z, 0xa20bc7c6u);
  EXPECT_EQ(o.w, 0x6d5451fdu);
  // Digits of pi: ctr = 243f6a88 85a308d3 13198a2e 03707344, key = a4093822 299f31d0.
  philox::U4 p = philox::philox4x32(0x299f31d0a4093822ull, 0x85a308d3243f6a88ull, 0x0370734413198a2eull);
  EXPECT_EQ(p.x, 0xd16cfe09u);
  EXPECT_EQ(p.y, 0x94fdccebu);
  EXPECT_EQ(p.z, 0x5001e420u);
  EXPECT_EQ(p.w, 0x24126ea1u);
}

TEST(Philox, SameSeedSameNumbers) {
  manual_seed(42);
  std::vector<float> a = rand({1000}).to_vector<float>();
  std::vector<float> an = randn({333}).to_vector<float>();
  manual_seed(42);
  std::vector<float> b = rand({1000}).to_vector<float>();
  std::vector<float> bn = randn({333}).to_vector<float>();
  EXPECT_EQ(a, b);
  EXPECT_EQ(an, bn);
  manual_seed(43);
  EXPECT_NE(rand({1000}).to_vector<float>(), a);
  // Consecutive draws differ (the counter advances).
  manual_seed(42);
  Tensor first = rand({8}), second = rand({8});
  EXPECT_NE(first.to_vector<float>(), second.to_vector<float>());
}

TEST(Philox, ElementIIsTheCounterFormula) {
  manual_seed(7);
  RngState s = default_generator().state();
  std::vector<float> u = rand({37}).to_vector<float>();
  for (size_t i = 0; i < u.size(); ++i) EXPECT_EQ(u[i], philox::uniform(s.seed, s.offset, i)) << i;
  // The generator reserved ceil(37 / 4) blocks.
  EXPECT_EQ(default_generator().state().offset, s.offset + 10);
}

TEST(Philox, IndependentOfHowATensorIsSplit) {
  // One draw of 100 equals draws of 40 and 60 (40 words fill whole 4-word
  // blocks, so the second draw starts where the first left off).
  manual_seed(1234);
  std::vector<float> whole = rand({100}).to_vector<float>();
  manual_seed(1234);
  std::vector<float> a = rand({40}).to_vector<float>();
  std::vector<float> b = rand({4, 15}).to_vector<float>();
  a.insert(a.end(), b.begin(), b.end());
  EXPECT_EQ(a, whole);
  // The same for normals (two words per element).
  manual_seed(99);
  std::vector<float> nwhole = randn({50}).to_vector<float>();
  manual_seed(99);
  std::vector<float> n1 = randn({2, 10}).to_vector<float>();
  std::vector<float> n2 = randn({30}).to_vector<float>();
  n1.insert(n1.end(), n2.begin(), n2.end());
  EXPECT_EQ(n1, nwhole);
}

TEST(Philox, IndependentOfThreadsAndDevices) {
  // A tensor large enough to be filled by several threads matches the
  // per-element formula everywhere, and the same draw on cpu:1 is identical.
  const int64_t n = int64_t{1} << 18;
  manual_seed(5);
  RngState s = default_generator().state();
  std::vector<float> big = rand({n}).to_vector<float>();
  for (int64_t i = 0; i < n; i += 997) ASSERT_EQ(big[i], philox::uniform(s.seed, s.offset, i)) << i;
  EXPECT_EQ(big[n - 1], philox::uniform(s.seed, s.offset, n - 1));
  manual_seed(5);
  std::vector<float> on1 = rand({n}, {kFloat32, Device("cpu:1")}).to_vector<float>();
  EXPECT_EQ(on1, big);
}

TEST(Philox, GeneratorStateRoundTrips) {
  manual_seed(11);
  rand({10});
  RngState saved = default_generator().state();
  std::vector<float> a = randn({20}).to_vector<float>();
  default_generator().set_state(saved);
  EXPECT_EQ(randn({20}).to_vector<float>(), a);
  Generator g(3);
  EXPECT_EQ(g.state().seed, 3u);
  RngState r = g.reserve(9);  // 9 words = 3 blocks
  EXPECT_EQ(r.offset, 0u);
  EXPECT_EQ(g.state().offset, 3u);
}

TEST(Philox, DistributionsHaveTheRightMoments) {
  manual_seed(2024);
  const int64_t n = 200000;
  std::vector<float> u = rand({n}).to_vector<float>();
  std::vector<float> z = randn({n}).to_vector<float>();
  double su = 0, su2 = 0, sz = 0, sz2 = 0;
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_GE(u[i], 0.0f);
    ASSERT_LT(u[i], 1.0f);
    su += u[i];
    su2 += u[i] * u[i];
    sz += z[i];
    sz2 += static_cast<double>(z[i]) * z[i];
  }
  // Standard errors: uniform mean 0.29/sqrt(n) ~ 6.5e-4; normal mean 1/sqrt(n) ~ 2.2e-3.
  EXPECT_NEAR(su / n, 0.5, 4e-3);
  EXPECT_NEAR(su2 / n - (su / n) * (su / n), 1.0 / 12.0, 2e-3);
  EXPECT_NEAR(sz / n, 0.0, 1e-2);
  EXPECT_NEAR(sz2 / n, 1.0, 1.5e-2);
  std::vector<int64_t> k = randint(-3, 4, {10000}).to_vector<int64_t>();
  std::set<int64_t> seen(k.begin(), k.end());
  EXPECT_EQ(seen, (std::set<int64_t>{-3, -2, -1, 0, 1, 2, 3}));
}

}  // namespace
}  // namespace chorus
