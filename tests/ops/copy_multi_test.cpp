// ops::copy_multi (Note [Multi-tensor copy]): many pairs of every dtype, odd
// sizes and layouts (flat, channels-last, strided views that take copy_),
// pairs on several devices, skipped self-copies, versions, and the argument
// errors, which name the pair and copy nothing. On a GPU: against the CPU
// result, with more pairs than one launch takes, a pair longer than one
// launch's blocks, and misaligned views (word and byte paths).
#include <gtest/gtest.h>

#include <chorus/chorus.h>
#include <chorus/ops/copy.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "testing/expect_error.h"

namespace chorus::ops {
namespace {

const Device kCpu0 = cpu_device(0);

// Random small integers in any dtype (exact in every one of them).
Tensor random_tensor(const Shape& sizes, DType dt, const Device& d, uint32_t seed) {
  manual_seed(seed);
  Tensor t = randint(0, 100, sizes, TensorOptions(kInt64, d));
  return dt == kInt64 ? t : t.to(dt);
}

// The bytes of t's elements in row-major order (copied to the host).
std::vector<uint8_t> bytes_of(const Tensor& t) {
  Tensor h = ops::contiguous(ops::to_device(t, kCpu0));
  std::vector<uint8_t> out(h.nbytes());
  if (!out.empty()) std::memcpy(out.data(), h.raw_data(), out.size());
  return out;
}

TEST(OpsCopyMulti, CopiesManyPairsOfEveryKind) {
  const std::vector<DType> dtypes = {kFloat32, kBFloat16, kFloat16, kInt64, kInt32, kUInt8, kBool};
  const std::vector<int64_t> sizes = {1, 2, 3, 7, 15, 16, 17, 255, 1000, 4097, 65537};
  TensorList srcs, dsts;
  std::mt19937 gen(1);
  for (int i = 0; i < 120; ++i) {
    const DType dt = dtypes[static_cast<size_t>(i) % dtypes.size()];
    const int64_t n = sizes[static_cast<size_t>(i) % sizes.size()];
    const Device d = cpu_device(i % 3);  // three batches, one per device
    srcs.push_back(random_tensor({n}, dt, d, static_cast<uint32_t>(i)));
    dsts.push_back(zeros({n}, TensorOptions(dt, d)));
  }
  // Dense tensors of any layout go through their flat views...
  Tensor cl_src = to_channels_last(random_tensor({2, 3, 5, 7}, kFloat32, kCpu0, 500));
  srcs.push_back(cl_src);
  dsts.push_back(to_channels_last(zeros({2, 3, 5, 7})));
  srcs.push_back(random_tensor({4, 6}, kFloat32, kCpu0, 501).t());  // transposed, both
  dsts.push_back(zeros({4, 6}).t());                                 // with the same strides
  // ...and others take copy_: a transposed source into a contiguous
  // destination, a strided slice, a broadcast-free narrow, another device.
  srcs.push_back(random_tensor({5, 3}, kFloat32, kCpu0, 502).t());
  dsts.push_back(zeros({3, 5}));
  Tensor wide = zeros({4, 10});
  srcs.push_back(random_tensor({4, 5}, kInt64, kCpu0, 503));
  dsts.push_back(wide.to(kInt64).slice(1, 0, 10, 2));
  srcs.push_back(random_tensor({33}, kBFloat16, cpu_device(1), 504));
  dsts.push_back(zeros({33}, TensorOptions(kBFloat16, cpu_device(2))));
  // Empty tensors, and a pair whose source is its destination.
  srcs.push_back(zeros({0}));
  dsts.push_back(zeros({0}));
  Tensor same = random_tensor({9}, kFloat32, kCpu0, 505);
  srcs.push_back(same);
  dsts.push_back(same);

  std::vector<std::vector<uint8_t>> want;
  for (const Tensor& s : srcs) want.push_back(bytes_of(s));
  std::vector<uint32_t> versions;
  for (const Tensor& d : dsts) versions.push_back(d.version());
  copy_multi(srcs, dsts);
  for (size_t i = 0; i < srcs.size(); ++i) {
    SCOPED_TRACE("pair " + std::to_string(i) + ": " + dsts[i].describe());
    EXPECT_EQ(bytes_of(dsts[i]), want[i]);
    if (dsts[i].numel() > 0 && !dsts[i].is_same(srcs[i])) EXPECT_GT(dsts[i].version(), versions[i]);
  }
  EXPECT_EQ(dsts[120].strides(), cl_src.strides());  // layouts are left alone
  copy_multi({}, {});  // nothing to do
}

TEST(OpsCopyMulti, BadArgumentsNameThePairAndCopyNothing) {
  Tensor a = ones({4}), b = ones({4}), c = zeros({4}), d = zeros({4});
  EXPECT_TRUE(test::throws_naming([&] { copy_multi({a, b}, {c}); }, {"copy_multi", "2 sources", "1 destination"}));
  EXPECT_TRUE(test::throws_naming([&] { copy_multi({a, Tensor()}, {c, d}); }, {"copy_multi", "pair 1", "undefined source"}));
  EXPECT_TRUE(test::throws_naming([&] { copy_multi({a, b}, {Tensor(), d}); },
                                  {"copy_multi", "pair 0", "undefined destination"}));
  EXPECT_TRUE(test::throws_naming([&] { copy_multi({a, ones({2, 2})}, {c, d}); },
                                  {"copy_multi", "pair 1", "float32[2, 2]", "float32[4]"}));
  EXPECT_TRUE(test::throws_naming([&] { copy_multi({a, b.to(kFloat64)}, {c, d}); },
                                  {"copy_multi", "pair 1", "float64[4]", "float32[4]"}));

  // Overlaps: the pairs are copied in no order.
  Tensor base = zeros({40});
  EXPECT_TRUE(test::throws_naming([&] { copy_multi({a, b, ones({10})}, {c, base.narrow(0, 0, 4), base.narrow(0, 2, 10)}); },
                                  {"copy_multi", "destinations of pairs 1 and 2 overlap"}));
  EXPECT_TRUE(test::throws_naming([&] { copy_multi({a, base.narrow(0, 10, 4)}, {base.narrow(0, 12, 4), d}); },
                                  {"copy_multi", "destination of pair 0 overlaps the source of pair 1"}));
  EXPECT_TRUE(test::throws_naming([&] { copy_multi({base.narrow(0, 20, 8)}, {base.narrow(0, 24, 8)}); },
                                  {"copy_multi", "destination of pair 0 overlaps its source"}));
  EXPECT_EQ(c.to_vector<float>(), std::vector<float>(4, 0.0f));
  EXPECT_EQ(d.to_vector<float>(), std::vector<float>(4, 0.0f));
  EXPECT_EQ(base.to_vector<float>(), std::vector<float>(40, 0.0f));
  // Adjacent spans do not overlap; sources may overlap each other.
  copy_multi({base.narrow(0, 30, 10), base.narrow(0, 32, 4)}, {base.narrow(0, 0, 10), base.narrow(0, 10, 4)});
  Tensor src = arange(0, 40, 1, {kFloat32});
  copy_multi({src.narrow(0, 0, 20), src.narrow(0, 10, 20)}, {base.narrow(0, 0, 20), base.narrow(0, 20, 20)});
  auto v = base.to_vector<float>();
  for (int i = 0; i < 20; ++i) {
    EXPECT_EQ(v[static_cast<size_t>(i)], static_cast<float>(i));
    EXPECT_EQ(v[static_cast<size_t>(20 + i)], static_cast<float>(10 + i));
  }
}

#ifdef CHORUS_WITH_CUDA
// The same pairs on the GPU and on the CPU must give the same bytes: more
// pairs than one launch's table (64), a pair longer than one launch's blocks
// (440 x 256 KiB), views at offsets that are 4-byte but not 16-byte aligned
// (word copies) and odd byte offsets (byte copies), every size around a vector
// or chunk boundary. With every pair (256 KiB chunks), and with the first 12
// (2 MB: 16 KiB chunks) and 26 (8.7 MB: 64 KiB chunks), where the chunk size
// follows the call's bytes and the larger pairs span many chunks.
TEST(OpsCopyMulti, GpuMatchesCpu_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const Device gpu = cuda_device(0);
  const std::vector<DType> dtypes = {kFloat32, kBFloat16, kInt64, kUInt8, kFloat16, kInt32};
  const std::vector<int64_t> sizes = {1, 3, 4, 5, 16, 17, 31, 1023, 65536, 65537, 262143, 262145, 700001};
  std::vector<Tensor> host_srcs;
  std::vector<std::pair<int64_t, int64_t>> offsets;  // (source, destination) element offsets
  std::vector<int64_t> lens;
  std::vector<DType> types;
  for (int i = 0; i < 150; ++i) {
    const DType dt = dtypes[static_cast<size_t>(i) % dtypes.size()];
    const int64_t n = sizes[static_cast<size_t>(i) % sizes.size()];
    const int64_t so = (i / 7) % 3, dof = (i / 5) % 2;  // 0, 1 or 2 elements in
    host_srcs.push_back(random_tensor({n + so}, dt, kCpu0, 1000 + static_cast<uint32_t>(i)));
    offsets.push_back({so, dof});
    lens.push_back(n);
    types.push_back(dt);
  }
  // One pair of 120 MiB: more than one launch's 440 blocks of 256 KiB.
  const int64_t big = (int64_t{120} << 20) / 4 + 3;
  host_srcs.push_back(random_tensor({big}, kFloat32, kCpu0, 7));
  offsets.push_back({0, 0});
  lens.push_back(big);
  types.push_back(kFloat32);

  auto run = [&](const Device& dev, size_t pairs) {
    TensorList srcs, dsts, bases;
    for (size_t i = 0; i < pairs; ++i) {
      Tensor s = ops::to_device(host_srcs[i], dev);
      Tensor base = zeros({lens[i] + offsets[i].second}, TensorOptions(types[i], dev));
      srcs.push_back(s.narrow(0, offsets[i].first, lens[i]));
      dsts.push_back(base.narrow(0, offsets[i].second, lens[i]));
      bases.push_back(base);
    }
    copy_multi(srcs, dsts);
    std::vector<std::vector<uint8_t>> out;
    for (const Tensor& b : bases) out.push_back(bytes_of(b));  // offsets' padding included
    return out;
  };
  for (size_t pairs : {host_srcs.size(), size_t{12}, size_t{26}}) {
    SCOPED_TRACE(std::to_string(pairs) + " pairs");
    const auto want = run(kCpu0, pairs);
    const auto got = run(gpu, pairs);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      SCOPED_TRACE("pair " + std::to_string(i) + ": " + std::to_string(lens[i]) + " x " + dtype_name(types[i]));
      ASSERT_EQ(got[i].size(), want[i].size());
      EXPECT_TRUE(got[i] == want[i]);
    }
  }
}
#endif  // CHORUS_WITH_CUDA

}  // namespace
}  // namespace chorus::ops
