// CPU indexing kernels against naive references written here with explicit
// multi-dimensional loops (PyTorch semantics), in float32, bfloat16 and int64,
// on random data and random indices with repeats (which the adds must sum).
#include <gtest/gtest.h>

#include <functional>
#include <random>
#include <string>
#include <vector>

#include "chorus/core/error.h"
#include "chorus/cpu/kernels.h"

namespace chorus::cpu {
namespace {

using Vec = std::vector<double>;

Tensor empty(const Shape& s, DType dt) {
  return detail::empty_tensor(s, dt, Device(DeviceType::CPU, 0));
}

Tensor tensor_of(const Shape& s, DType dt, const Vec& v) {
  Tensor t = empty(s, dt);
  for (size_t i = 0; i < v.size(); ++i) {
    switch (dt) {
      case kFloat32: t.data<float>()[i] = static_cast<float>(v[i]); break;
      case kBFloat16: t.data<BFloat16>()[i] = BFloat16(static_cast<float>(v[i])); break;
      case kInt64: t.data<int64_t>()[i] = static_cast<int64_t>(v[i]); break;
      default: ADD_FAILURE() << "unexpected dtype " << dt;
    }
  }
  return t;
}

Vec values_of(const Tensor& t) {
  Vec v(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) {
    switch (t.dtype()) {
      case kFloat32: v[i] = t.data<float>()[i]; break;
      case kBFloat16: v[i] = static_cast<float>(t.data<BFloat16>()[i]); break;
      case kInt64: v[i] = static_cast<double>(t.data<int64_t>()[i]); break;
      default: ADD_FAILURE() << "unexpected dtype " << t.dtype();
    }
  }
  return v;
}

// Small integers: they and their sums here (< 256) are exact in bfloat16 too,
// so results compare exactly.
Vec random_ints(int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> dist(-10, 10);
  Vec v(n);
  for (double& e : v) {
    do e = dist(gen); while (e == 0);
  }
  return v;
}

Tensor random_index(const Shape& s, int64_t bound, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int64_t> dist(0, bound - 1);
  Tensor t = empty(s, kInt64);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<int64_t>()[i] = dist(gen);
  return t;
}

int64_t flat(const Shape& s, int64_t a, int64_t b, int64_t c) { return (a * s[1] + b) * s[2] + c; }

const DType kDTypes[] = {kFloat32, kBFloat16, kInt64};

TEST(IndexCpu, IndexSelectMatchesNaive) {
  const Shape xs = {3, 5, 4};
  for (DType dt : kDTypes) {
    const Vec x = random_ints(60, 1);
    Tensor index = random_index({6}, 5, 2);
    Tensor out = empty({3, 6, 4}, dt);
    index_select(tensor_of(xs, dt, x), -2, index, out);
    const Vec got = values_of(out);
    for (int64_t a = 0; a < 3; ++a)
      for (int64_t i = 0; i < 6; ++i)
        for (int64_t c = 0; c < 4; ++c)
          ASSERT_EQ(got[flat({3, 6, 4}, a, i, c)], x[flat(xs, a, index.data<int64_t>()[i], c)])
              << dt;
  }
}

TEST(IndexCpu, IndexAddSumsRepeatedIndices) {
  const Shape os = {3, 5, 4}, ss = {3, 8, 4};
  for (DType dt : kDTypes) {
    Vec want = random_ints(60, 3);
    const Vec src = random_ints(96, 4);
    Tensor out = tensor_of(os, dt, want);
    Tensor index = random_index({8}, 5, 5);  // 8 picks of 5 rows: repeats
    index_add(out, 1, index, tensor_of(ss, dt, src));
    for (int64_t a = 0; a < 3; ++a)
      for (int64_t i = 0; i < 8; ++i)
        for (int64_t c = 0; c < 4; ++c)
          want[flat(os, a, index.data<int64_t>()[i], c)] += src[flat(ss, a, i, c)];
    EXPECT_EQ(values_of(out), want) << dt;
  }
}

// index [2, 3, 4] with 6 along `dim`, into data [3, 4, 5]: smaller than the
// data in the other dims, larger along dim, as PyTorch allows.
Shape index_shape(int64_t dim) {
  Shape s = {2, 3, 4};
  s[dim] = 6;
  return s;
}

TEST(IndexCpu, GatherWithSmallerIndexMatchesNaive) {
  const Shape xs = {3, 4, 5};
  for (DType dt : kDTypes) {
    for (int64_t dim : {0, 1, 2}) {
      const Shape is = index_shape(dim);
      const Vec x = random_ints(60, 6);
      Tensor index = random_index(is, xs[dim], 7 + uint32_t(dim));
      Tensor out = empty(is, dt);
      gather(tensor_of(xs, dt, x), dim, index, out);
      const Vec got = values_of(out);
      for (int64_t a = 0; a < is[0]; ++a)
        for (int64_t b = 0; b < is[1]; ++b)
          for (int64_t c = 0; c < is[2]; ++c) {
            int64_t at[3] = {a, b, c};
            at[dim] = index.data<int64_t>()[flat(is, a, b, c)];
            ASSERT_EQ(got[flat(is, a, b, c)], x[flat(xs, at[0], at[1], at[2])])
                << dt << " dim " << dim;
          }
    }
  }
}

TEST(IndexCpu, ScatterAddWithSmallerIndexMatchesNaive) {
  const Shape os = {3, 4, 5};
  for (DType dt : kDTypes) {
    for (int64_t dim : {0, 1, 2}) {
      const Shape is = index_shape(dim);
      const Shape ss = {is[0] + 1, is[1] + 1, is[2] + 1};  // src may exceed index
      Vec want = random_ints(60, 8);
      const Vec src = random_ints(numel_of(ss), 9);
      Tensor out = tensor_of(os, dt, want);
      Tensor index = random_index(is, os[dim], 10 + uint32_t(dim));
      scatter_add(out, dim, index, tensor_of(ss, dt, src));
      for (int64_t a = 0; a < is[0]; ++a)
        for (int64_t b = 0; b < is[1]; ++b)
          for (int64_t c = 0; c < is[2]; ++c) {
            int64_t at[3] = {a, b, c};
            at[dim] = index.data<int64_t>()[flat(is, a, b, c)];
            want[flat(os, at[0], at[1], at[2])] += src[flat(ss, a, b, c)];
          }
      EXPECT_EQ(values_of(out), want) << dt << " dim " << dim;
    }
  }
}

TEST(IndexCpu, OutOfRangeIndexNamesOpIndexAndSizeAndLeavesOutUntouched) {
  Tensor x = tensor_of({2, 3}, kFloat32, {1, 2, 3, 4, 5, 6});
  Tensor index = tensor_of({2, 2}, kInt64, {0, 1, 2, 0});
  auto expect_error = [](const std::function<void()>& f, const std::string& op,
                         const std::string& bad, const std::string& size) {
    try {
      f();
      FAIL() << op << ": no error";
    } catch (const ValueError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(op), std::string::npos) << msg;
      EXPECT_NE(msg.find("index " + bad), std::string::npos) << msg;
      EXPECT_NE(msg.find("size " + size), std::string::npos) << msg;
    }
  };
  Tensor out = tensor_of({2, 2}, kFloat32, {7, 7, 7, 7});
  expect_error([&] { gather(x, 0, index, out); }, "gather", "2", "2");
  Tensor target = tensor_of({2, 3}, kFloat32, {7, 7, 7, 7, 7, 7});
  expect_error([&] { scatter_add(target, 0, index, x); }, "scatter_add", "2", "2");
  EXPECT_EQ(values_of(target), Vec(6, 7.0));
  Tensor row_index = tensor_of({2}, kInt64, {1, -1});
  Tensor selected = empty({2, 2}, kFloat32);
  expect_error([&] { index_select(x, 1, row_index, selected); }, "index_select", "-1", "3");
  Tensor sum = tensor_of({2, 3}, kFloat32, {7, 7, 7, 7, 7, 7});
  expect_error([&] { index_add(sum, 0, tensor_of({2}, kInt64, {0, 5}), x); }, "index_add", "5",
               "2");
  EXPECT_EQ(values_of(sum), Vec(6, 7.0));
}

}  // namespace
}  // namespace chorus::cpu
