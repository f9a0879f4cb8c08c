// Joining, splitting and indexing ops against naive references: cat / split
// round trips, stack, chunk, index_select and gather (every dtype that makes
// sense), and errors that name the op and the shapes.
#include <gtest/gtest.h>

#include <chorus/chorus.h>
#include <chorus/ops/indexing.h>

#include "testing/expect_error.h"
#include "testing/gradcheck.h"

namespace chorus {
namespace {

using test::throws_naming;

using test::uniform_values;

Tensor rnd(const Shape& s, uint64_t seed) { return from_vector(uniform_values(numel_of(s), seed), s); }
Tensor ints(const std::vector<int64_t>& v, const Shape& s) { return from_vector(v, s); }

TEST(OpsJoin, CatMatchesANaiveCopy) {
  Tensor a = rnd({2, 3, 4}, 1), b = rnd({2, 1, 4}, 2), c = rnd({2, 2, 4}, 3);
  Tensor out = cat({a, b, c}, 1);
  EXPECT_EQ(out.sizes(), (Shape{2, 6, 4}));
  std::vector<float> av = a.to_vector<float>(), bv = b.to_vector<float>(), cv = c.to_vector<float>();
  std::vector<float> got = out.to_vector<float>();
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t j = 0; j < 6; ++j)
      for (int64_t k = 0; k < 4; ++k) {
        float want = j < 3 ? av[(i * 3 + j) * 4 + k] : j < 4 ? bv[(i * 1 + j - 3) * 4 + k] : cv[(i * 2 + j - 4) * 4 + k];
        EXPECT_EQ(got[(i * 6 + j) * 4 + k], want);
      }
  EXPECT_EQ(cat({a, a}, -1).sizes(), (Shape{2, 3, 8}));
  EXPECT_EQ(cat({a}, 0).to_vector<float>(), av);
}

TEST(OpsJoin, CatSplitRoundTrip) {
  Tensor x = rnd({5, 7}, 4);
  for (int64_t dim : {0, 1}) {
    for (int64_t size : {1, 2, 3, 7}) {
      TensorList parts = split(x, size, dim);
      int64_t total = 0;
      for (size_t p = 0; p < parts.size(); ++p) {
        EXPECT_LE(parts[p].size(dim), size);
        if (p + 1 < parts.size()) EXPECT_EQ(parts[p].size(dim), size);
        EXPECT_EQ(parts[p].storage(), x.storage());  // views, no copies
        total += parts[p].size(dim);
      }
      EXPECT_EQ(total, x.size(dim));
      EXPECT_EQ(cat(parts, dim).to_vector<float>(), x.to_vector<float>()) << "dim " << dim << " size " << size;
    }
  }
  TensorList uneven = split_sizes(x, {2, 0, 5}, 1);
  ASSERT_EQ(uneven.size(), 3u);
  EXPECT_EQ(uneven[1].sizes(), (Shape{5, 0}));
  EXPECT_EQ(cat(uneven, 1).to_vector<float>(), x.to_vector<float>());
}

TEST(OpsJoin, ChunkSizes) {
  Tensor x = arange(10, {kFloat32});
  auto sizes = [](const TensorList& ts) {
    std::vector<int64_t> s;
    for (const Tensor& t : ts) s.push_back(t.size(0));
    return s;
  };
  EXPECT_EQ(sizes(chunk(x, 3)), (std::vector<int64_t>{4, 4, 2}));
  EXPECT_EQ(sizes(chunk(x, 5)), (std::vector<int64_t>{2, 2, 2, 2, 2}));
  EXPECT_EQ(sizes(chunk(x, 4)), (std::vector<int64_t>{3, 3, 3, 1}));
  EXPECT_EQ(sizes(chunk(x, 1)), (std::vector<int64_t>{10}));
  EXPECT_EQ(chunk(x, 3)[2].to_vector<float>(), (std::vector<float>{8, 9}));
  // Like PyTorch, more chunks than elements gives one element per chunk.
  EXPECT_EQ(sizes(chunk(arange(3, {kFloat32}), 5)), (std::vector<int64_t>{1, 1, 1}));
}

TEST(OpsJoin, Stack) {
  Tensor a = rnd({2, 3}, 5), b = rnd({2, 3}, 6);
  std::vector<float> av = a.to_vector<float>(), bv = b.to_vector<float>();
  Tensor s0 = stack({a, b}, 0), s1 = stack({a, b}, 1), s2 = stack({a, b}, -1);
  EXPECT_EQ(s0.sizes(), (Shape{2, 2, 3}));
  EXPECT_EQ(s1.sizes(), (Shape{2, 2, 3}));
  EXPECT_EQ(s2.sizes(), (Shape{2, 3, 2}));
  std::vector<float> g1 = s1.to_vector<float>(), g2 = s2.to_vector<float>();
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t j = 0; j < 3; ++j) {
      EXPECT_EQ(g1[(i * 2 + 0) * 3 + j], av[i * 3 + j]);
      EXPECT_EQ(g1[(i * 2 + 1) * 3 + j], bv[i * 3 + j]);
      EXPECT_EQ(g2[(i * 3 + j) * 2 + 0], av[i * 3 + j]);
      EXPECT_EQ(g2[(i * 3 + j) * 2 + 1], bv[i * 3 + j]);
    }
  EXPECT_EQ(s0.select(0, 1).to_vector<float>(), bv);
}

TEST(OpsJoin, MixedDtypesAndDevices) {
  Tensor f = from_vector(std::vector<float>{0.5f, 1.5f}, {2});
  Tensor i = ints({3, 4}, {2});
  Tensor c = cat({i, f});
  EXPECT_EQ(c.dtype(), kFloat32);
  EXPECT_EQ(c.to_vector<float>(), (std::vector<float>{3, 4, 0.5f, 1.5f}));
  Tensor on1 = f.to(Device("cpu:1"));
  Tensor d = cat({on1, f});
  EXPECT_EQ(d.device(), cpu_device(1));
  EXPECT_EQ(d.to_vector<float>(), (std::vector<float>{0.5f, 1.5f, 0.5f, 1.5f}));
  EXPECT_EQ(cat({ints({1, 2}, {2}), ints({3}, {1})}).to_vector<int64_t>(), (std::vector<int64_t>{1, 2, 3}));
}

TEST(OpsIndex, IndexSelectMatchesNaive) {
  Tensor x = rnd({4, 5, 3}, 7);
  std::vector<float> xv = x.to_vector<float>();
  std::vector<int64_t> idx = {4, 0, 4, 2};
  Tensor out = index_select(x, 1, ints(idx, {4}));
  EXPECT_EQ(out.sizes(), (Shape{4, 4, 3}));
  std::vector<float> got = out.to_vector<float>();
  for (int64_t i = 0; i < 4; ++i)
    for (int64_t j = 0; j < 4; ++j)
      for (int64_t k = 0; k < 3; ++k) EXPECT_EQ(got[(i * 4 + j) * 3 + k], xv[(i * 5 + idx[j]) * 3 + k]);
  // Dim 0, an int32 index, a non-contiguous source and integer data.
  Tensor rows = index_select(x.t(), 0, ints({2, 2}, {2}).to(kInt32));  // x.t(): [5, 4, 3]
  EXPECT_EQ(rows.sizes(), (Shape{2, 4, 3}));
  EXPECT_EQ(rows.select(0, 0).to_vector<float>(), x.select(1, 2).to_vector<float>());
  Tensor data = ints({10, 11, 12, 13, 14, 15}, {3, 2});
  EXPECT_EQ(index_select(data, 0, ints({2, 0}, {2})).to_vector<int64_t>(), (std::vector<int64_t>{14, 15, 10, 11}));
  EXPECT_EQ(index_select(data, -1, ints({1}, {1})).to_vector<int64_t>(), (std::vector<int64_t>{11, 13, 15}));
}

TEST(OpsIndex, GatherMatchesNaive) {
  Tensor x = rnd({3, 4}, 8);
  std::vector<float> xv = x.to_vector<float>();
  std::vector<int64_t> i1 = {3, 0, 3, 1, 1, 2};  // [3, 2]
  std::vector<float> g1 = gather(x, 1, ints(i1, {3, 2})).to_vector<float>();
  for (int64_t r = 0; r < 3; ++r)
    for (int64_t c = 0; c < 2; ++c) EXPECT_EQ(g1[r * 2 + c], xv[r * 4 + i1[r * 2 + c]]);
  std::vector<int64_t> i0 = {2, 0, 1, 1, 0, 0, 2, 2};  // [2, 4]
  std::vector<float> g0 = gather(x, 0, ints(i0, {2, 4})).to_vector<float>();
  for (int64_t r = 0; r < 2; ++r)
    for (int64_t c = 0; c < 4; ++c) EXPECT_EQ(g0[r * 4 + c], xv[i0[r * 4 + c] * 4 + c]);
  // An index smaller than the input in the other dims, as PyTorch allows.
  std::vector<float> gs = gather(x, 1, ints({1, 2}, {2, 1})).to_vector<float>();
  EXPECT_EQ(gs, (std::vector<float>{xv[1], xv[4 + 2]}));
  // Integer data.
  Tensor data = ints({10, 11, 12, 13, 14, 15}, {3, 2});
  EXPECT_EQ(gather(data, 1, ints({1, 0, 0}, {3, 1})).to_vector<int64_t>(), (std::vector<int64_t>{11, 12, 14}));
}

// ops::scatter_add_ adds into the tensor that is there (repeated indices
// sum), as scatter_add_zeros does into zeros, and refuses a non-contiguous
// target in one line.
TEST(OpsIndex, ScatterAddInPlaceAddsToTheExistingValues) {
  Tensor base = rnd({3, 5}, 7), src = rnd({3, 2}, 8);
  Tensor index = ints({4, 0, 1, 1, 2, 4}, {3, 2});
  Tensor out = base.clone();
  ops::scatter_add_(out, 1, index, src);
  const std::vector<float> b = base.to_vector<float>(), sv = src.to_vector<float>(), got = out.to_vector<float>();
  const std::vector<int64_t> iv = index.to_vector<int64_t>();
  std::vector<float> want = b;
  for (int64_t r = 0; r < 3; ++r)
    for (int64_t j = 0; j < 2; ++j) want[r * 5 + iv[r * 2 + j]] += sv[r * 2 + j];
  for (size_t i = 0; i < want.size(); ++i) EXPECT_FLOAT_EQ(got[i], want[i]) << i;
  Tensor zeros_way = ops::scatter_add_zeros({3, 5}, 1, index, src);
  EXPECT_LE(out.sub(base).sub(zeros_way).abs().max().item<float>(), 1e-6f);  // (base + s) - base: rounding
  EXPECT_TRUE(throws_naming([&] { ops::scatter_add_(base.t(), 0, ints({0}, {1, 1}), rnd({1, 1}, 9)); },
                            {"scatter_add_", "contiguous"}));
}

TEST(OpsIndex, OutOfRangeIndicesAreRejected) {
  Tensor x = rnd({3, 4}, 9);
  EXPECT_TRUE(throws_naming([&] { index_select(x, 0, ints({0, 3}, {2})); }, {"index_select", "3"}));
  EXPECT_TRUE(throws_naming([&] { index_select(x, 1, ints({-1}, {1})); }, {"index_select", "-1"}));
  EXPECT_TRUE(throws_naming([&] { gather(x, 1, ints({0, 4, 0}, {3, 1})); }, {"gather", "4"}));
}

TEST(OpsIndex, ShapeErrorsNameTheOpAndTheShapes) {
  Tensor a = zeros({2, 3}), b = zeros({3, 3});
  EXPECT_TRUE(throws_naming([&] { cat({a, b}, 1); }, {"cat", "[2, 3]", "[3, 3]"}));
  EXPECT_TRUE(throws_naming([&] { cat({a, zeros({2, 3, 1})}, 0); }, {"cat", "[2, 3]", "[2, 3, 1]"}));
  EXPECT_TRUE(throws_naming([&] { cat({}, 0); }, {"cat"}));
  EXPECT_TRUE(throws_naming([&] { stack({a, b}); }, {"stack", "[2, 3]", "[3, 3]"}));
  EXPECT_TRUE(throws_naming([&] { split_sizes(a, {1, 1}, 1); }, {"split", "3"}));
  EXPECT_TRUE(throws_naming([&] { split(a, 0, 1); }, {"split"}));
  EXPECT_TRUE(throws_naming([&] { chunk(a, 0, 1); }, {"chunk"}));
  EXPECT_TRUE(throws_naming([&] { index_select(a, 0, ints({0, 1, 0, 1}, {2, 2})); }, {"index_select", "[2, 2]"}));
  EXPECT_TRUE(throws_naming([&] { index_select(a, 0, zeros({2})); }, {"index_select", "float32"}));
  EXPECT_TRUE(throws_naming([&] { index_select(a, 2, ints({0}, {1})); }, {"index_select", "dim"}));
  EXPECT_TRUE(throws_naming([&] { gather(a, 1, ints({0, 0}, {2})); }, {"gather", "[2]", "[2, 3]"}));
  EXPECT_TRUE(throws_naming([&] { gather(a, 1, ints({0, 0, 0, 0, 0, 0, 0, 0}, {4, 2})); }, {"gather", "[4, 2]", "[2, 3]"}));
}

}  // namespace
}  // namespace chorus
