// ops::broadcast_coalesced, ops::reduce_sum and reduce_sum_after: on logical CPU devices (the
// copy/add fallback, run in CI) and on two or more GPUs (NCCL), against sums
// computed on the host.
#include <gtest/gtest.h>

#include <chorus/chorus.h>
#include <chorus/ops/comm.h>
#include <chorus/ops/copy.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "testing/random.h"
#include "testing/expect_error.h"

namespace chorus::ops {
namespace {

using chorus::testing::random_vector;

Tensor on(const std::vector<float>& v, const Device& d, DType dtype = kFloat32) {
  return from_vector(v, {static_cast<int64_t>(v.size())}, TensorOptions(dtype, d));
}

// Checks broadcast and reduce over `devices` for an n-element buffer of dtype,
// against the host: exact for the broadcast, float rounding for the sum.
void check_collectives(const std::vector<Device>& devices, int64_t n, DType dtype, double tol) {
  SCOPED_TRACE(std::string(dtype_name(dtype)) + ", " + std::to_string(n) + " elements");
  // Values rounded to dtype first, so the host sums exactly what the devices hold.
  std::vector<std::vector<float>> vals;
  std::vector<Tensor> bufs;
  for (size_t i = 0; i < devices.size(); ++i) {
    Tensor t = on(random_vector(n, 100 + static_cast<uint32_t>(i)), devices[i], dtype);
    vals.push_back(t.to(kFloat32).to_vector<float>());
    bufs.push_back(t);
  }

  // reduce_sum into a separate buffer, then in place into the first source.
  std::vector<double> want(static_cast<size_t>(n), 0.0);
  for (const auto& v : vals)
    for (size_t j = 0; j < v.size(); ++j) want[j] += v[j];
  double scale = 0;
  for (double w : want) scale = std::max(scale, std::abs(w));
  auto check_sum = [&](const Tensor& got, const char* what) {
    SCOPED_TRACE(what);
    EXPECT_EQ(got.device(), devices[0]);
    auto g = got.to(kFloat32).to_vector<float>();
    ASSERT_EQ(g.size(), want.size());
    double err = 0;
    for (size_t j = 0; j < g.size(); ++j) err = std::max(err, std::abs(g[j] - want[j]));
    EXPECT_LE(err / std::max(scale, 1e-12), tol);
  };
  Tensor dst = empty({n}, TensorOptions(dtype, devices[0]));
  reduce_sum(bufs, dst);
  check_sum(dst, "separate destination");
  for (size_t i = 1; i < devices.size(); ++i)  // the sources are unchanged
    EXPECT_TRUE(bufs[i].to(kFloat32).to_vector<float>() == vals[i]) << devices[i].str();
  // Ordered by events recorded after each source was written, joined after.
  std::vector<Event> ready;
  for (const Device& d : devices) {
    ready.emplace_back(d, /*timing=*/false);
    ready.back().record();
  }
  Tensor dst_after = empty({n}, TensorOptions(dtype, devices[0]));
  reduce_sum_after(bufs, dst_after, ready);
  comm_join(devices[0]);
  check_sum(dst_after, "reduce_sum_after");
  reduce_sum(bufs, bufs[0]);
  check_sum(bufs[0], "in place");

  // broadcast_coalesced: every destination becomes the source, bit for bit.
  Tensor src = on(random_vector(n, 7), devices[0], dtype);
  std::vector<Tensor> dsts;
  for (size_t i = 1; i < devices.size(); ++i) dsts.push_back(empty({n}, TensorOptions(dtype, devices[i])));
  broadcast_coalesced(src, dsts);
  auto want_b = src.to(kFloat32).to_vector<float>();
  for (size_t i = 0; i < dsts.size(); ++i) {
    EXPECT_EQ(dsts[i].device(), devices[i + 1]);
    EXPECT_TRUE(dsts[i].to(kFloat32).to_vector<float>() == want_b) << devices[i + 1].str();
  }
}

TEST(Comm, CpuDevicesBroadcastAndReduce) {
  check_collectives({cpu_device(0), cpu_device(1), cpu_device(2)}, 1000, kFloat32, 1e-6);
  check_collectives({cpu_device(2), cpu_device(0)}, 33, kFloat32, 1e-6);
  check_collectives({cpu_device(0), cpu_device(1)}, 100, kBFloat16, 1e-2);
  check_collectives({cpu_device(1)}, 10, kFloat32, 0);  // one device: a copy
}

TEST(Comm, ReduceSumAddsInDeviceOrderOnCpu) {
  // Deterministic: the same inputs give bit-identical sums, run after run.
  std::vector<Tensor> srcs;
  for (int i = 0; i < 4; ++i) srcs.push_back(on(random_vector(257, 40 + i), cpu_device(i)));
  Tensor a = empty({257}, TensorOptions(kFloat32, cpu_device(0)));
  Tensor b = empty({257}, TensorOptions(kFloat32, cpu_device(0)));
  reduce_sum(srcs, a);
  reduce_sum(srcs, b);
  EXPECT_EQ(a.to_vector<float>(), b.to_vector<float>());
  Tensor ref = srcs[0].clone();
  for (int i = 1; i < 4; ++i) ref = ref + srcs[i].to(cpu_device(0));
  EXPECT_EQ(a.to_vector<float>(), ref.to_vector<float>());
}

TEST(Comm, BadArgumentsAreValueErrors) {
  Tensor a = zeros({4}, cpu_device(0)), b = zeros({4}, cpu_device(1));
  EXPECT_TRUE(test::throws_naming([&] { reduce_sum({}, a); }, {"reduce_sum", "no source"}));
  EXPECT_TRUE(test::throws_naming([&] { reduce_sum({a, b}, zeros({4}, cpu_device(1))); },
                                    {"reduce_sum", "cpu:1", "cpu:0"}));
  EXPECT_TRUE(test::throws_naming([&] { reduce_sum({a, zeros({5}, cpu_device(1))}, a); },
                                    {"reduce_sum", "same shape"}));
  EXPECT_TRUE(test::throws_naming([&] { reduce_sum({a, zeros({4}, TensorOptions(kInt64, cpu_device(1)))}, a); },
                                    {"reduce_sum", "int64"}));
  EXPECT_TRUE(test::throws_naming([&] { reduce_sum({a, zeros({4}, cpu_device(0))}, a); },
                                    {"reduce_sum", "cpu:0", "once"}));
  Event e0(cpu_device(0)), e1(cpu_device(1));
  EXPECT_TRUE(test::throws_naming([&] { reduce_sum_after({a, b}, a, {e0}); }, {"reduce_sum_after", "1 events", "2 sources"}));
  EXPECT_TRUE(test::throws_naming([&] { reduce_sum_after({a, b}, a, {e1, e0}); },
                                    {"reduce_sum_after", "event of source 0", "cpu:1", "cpu:0"}));
  EXPECT_TRUE(test::throws_naming([&] { broadcast_coalesced(a, {zeros({4}, cpu_device(0))}); },
                                    {"broadcast_coalesced", "once"}));
  EXPECT_TRUE(test::throws_naming([&] { broadcast_coalesced(a, {zeros({4}, TensorOptions(kBFloat16, cpu_device(1)))}); },
                                    {"broadcast_coalesced", "bfloat16"}));
  EXPECT_TRUE(test::throws_naming([&] { broadcast_coalesced(zeros({2, 4}, cpu_device(0)).t(), {b}); },
                                    {"broadcast_coalesced", "contiguous"}));
}

#ifdef CHORUS_WITH_CUDA
std::vector<Device> all_gpus() {
  std::vector<Device> out;
  for (int i = 0; i < cuda_device_count(); ++i) out.push_back(cuda_device(i));
  return out;
}

TEST(Comm, GpusBroadcastAndReduce_MultiCUDA) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  const std::vector<Device> gpus = all_gpus();
  // Large enough for NCCL to split the buffer into many chunks; odd sizes.
  // NCCL adds in the buffer's dtype, one rounding per device: bfloat16 loses
  // up to 2^-9 of the scale per add.
  check_collectives(gpus, (int64_t{1} << 22) + 3, kFloat32, 2e-6);
  check_collectives(gpus, 1001, kBFloat16, 3e-2);
  check_collectives({gpus[1], gpus[0]}, 4097, kFloat32, 2e-6);  // root on cuda:1
  check_collectives({gpus[0], gpus[1]}, 1, kFloat32, 2e-6);
  synchronize();
}

// The collective is ordered with the work around it on the current streams:
// a kernel right before it produces the input, one right after reads the
// output, with no synchronisation by the caller.
TEST(Comm, CollectivesAreOrderedWithSurroundingWork_MultiCUDA) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  const Device g0 = cuda_device(0), g1 = cuda_device(1);
  const int64_t n = int64_t{1} << 24;
  for (int iter = 0; iter < 3; ++iter) {
    Tensor a = full({n}, 1.0, TensorOptions(kFloat32, g0));
    Tensor b = full({n}, 2.0, TensorOptions(kFloat32, g1));
    a.mul_(3.0);  // enqueued just before: a = 3
    b.mul_(5.0);  // b = 10
    reduce_sum({a, b}, a);
    a.add_(a, 1.0);  // just after: a = 26
    EXPECT_EQ(a.max().item(), 26.0);
    EXPECT_EQ(a.neg().max().item(), -26.0);
    Tensor c = empty({n}, TensorOptions(kFloat32, g1));
    broadcast_coalesced(a, {c});
    c.mul_(0.5);
    EXPECT_EQ(c.max().item(), 13.0);
    EXPECT_EQ(c.neg().max().item(), -13.0);
  }
}

// Note [Overlapped collectives]: the sum waits only for the events, the
// current streams do not wait for it until comm_join, and a source dropped
// right after the call is not reused while the collective still reads it.
TEST(Comm, ReduceAfterEventsKeepsBuffersAndJoins_MultiCUDA) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  const std::vector<Device> gpus = all_gpus();
  const int64_t n = int64_t{1} << 24;
  for (int iter = 0; iter < 3; ++iter) {
    std::vector<Tensor> srcs;
    std::vector<Event> ready;
    double want = 0;
    for (size_t i = 0; i < gpus.size(); ++i) {
      Tensor t = full({n}, 1.0, TensorOptions(kFloat32, gpus[i]));
      t.mul_(static_cast<double>(i + 2));  // written by a kernel just before the event
      want += static_cast<double>(i + 2);
      srcs.push_back(t);
      ready.emplace_back(gpus[i], /*timing=*/false);
      ready.back().record();
    }
    Tensor dst = empty({n}, TensorOptions(kFloat32, gpus[0]));
    reduce_sum_after(srcs, dst, ready);
    // Sources dropped at once; new tensors of the same size on the same
    // streams must not get their memory while the sum may still read it.
    for (size_t i = 1; i < srcs.size(); ++i) srcs[i] = Tensor();
    std::vector<Tensor> scribble;
    for (size_t i = 1; i < gpus.size(); ++i) scribble.push_back(full({n}, -1000.0, TensorOptions(kFloat32, gpus[i])));
    comm_join(gpus[0]);
    dst.add_(dst, 1.0);  // after the join: 2 * want everywhere
    EXPECT_EQ(dst.max().item(), 2 * want);
    EXPECT_EQ(dst.neg().max().item(), -2 * want);
  }
}

// Note [Copy-engine all-reduce] in cuda/kernels/peer_all_reduce.h: every buffer ends
// up bit for bit equal to the sum in rank order accumulated in float and
// rounded once, computed here on the host; sizes that do not split evenly
// into 16-byte chunks, one element, and devices in both orders.
void check_all_reduce(const std::vector<Device>& devices, int64_t n, DType dtype) {
  // By the copy engines (copy_engine_all_reduce_sum_after), which must take it.
  SCOPED_TRACE(std::string(dtype_name(dtype)) + ", " + std::to_string(n) + " elements, first " + devices[0].str());
  std::vector<Tensor> bufs;
  std::vector<std::vector<float>> vals;
  std::vector<Event> ready;
  for (size_t i = 0; i < devices.size(); ++i) {
    Tensor t = on(random_vector(n, 300 + static_cast<uint32_t>(i)), devices[i], dtype);
    t.mul_(static_cast<double>(i + 1));  // written by a kernel just before the event
    vals.push_back(t.to(kFloat32).to_vector<float>());
    bufs.push_back(t);
    ready.emplace_back(devices[i], /*timing=*/false);
    ready.back().record();
  }
  std::vector<float> sum(static_cast<size_t>(n), 0.f);
  for (const auto& v : vals)
    for (size_t k = 0; k < sum.size(); ++k) sum[k] += v[k];
  const std::vector<float> want = on(sum, cpu_device(0)).to(dtype).to(kFloat32).to_vector<float>();
  // Without peer access the copy engines take nothing: NCCL's sum then.
  if (!copy_engine_all_reduce_sum_after(bufs, ready)) all_reduce_sum_after(bufs, ready);
  for (size_t i = 0; i < devices.size(); ++i) {
    comm_join(devices[i]);
    const std::vector<float> got = bufs[i].to(kFloat32).to_vector<float>();
    size_t wrong = 0;
    for (size_t k = 0; k < got.size(); ++k) wrong += got[k] != want[k];
    EXPECT_EQ(wrong, 0u) << "buffer on " << devices[i].str();
  }
}

TEST(Comm, CopyEngineAllReduceEqualsTheSumInRankOrder_MultiCUDA) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  const std::vector<Device> gpus = all_gpus();
  for (int64_t n : {(int64_t{1} << 22) + 3, int64_t{4097}, int64_t{7}, int64_t{1}}) {
    check_all_reduce(gpus, n, kFloat32);
    check_all_reduce({gpus[1], gpus[0]}, n, kFloat32);
  }
  check_all_reduce(gpus, (int64_t{1} << 20) + 5, kBFloat16);
  check_all_reduce(gpus, 1001, kFloat16);
  synchronize();
}

// The copy engines' sum waits only for the events, and buffers dropped right
// after the call are not reused while the copies still read or write them.
TEST(Comm, CopyEngineAllReduceKeepsBuffersUntilJoined_MultiCUDA) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  const std::vector<Device> gpus = all_gpus();
  const int64_t n = (int64_t{1} << 24) + 9;
  for (int iter = 0; iter < 3; ++iter) {
    std::vector<Tensor> bufs;
    std::vector<Event> ready;
    double want = 0;
    for (size_t i = 0; i < gpus.size(); ++i) {
      bufs.push_back(full({n}, 1.0, TensorOptions(kFloat32, gpus[i])));
      bufs.back().mul_(static_cast<double>(i + 2));
      want += static_cast<double>(i + 2);
      ready.emplace_back(gpus[i], /*timing=*/false);
      ready.back().record();
    }
    if (!copy_engine_all_reduce_sum_after(bufs, ready)) all_reduce_sum_after(bufs, ready);
    Tensor kept = bufs[0];
    for (size_t i = 1; i < bufs.size(); ++i) bufs[i] = Tensor();
    std::vector<Tensor> scribble;
    for (size_t i = 0; i < gpus.size(); ++i) scribble.push_back(full({n}, -1000.0, TensorOptions(kFloat32, gpus[i])));
    comm_join(gpus[0]);
    kept.add_(kept, 1.0);
    EXPECT_EQ(kept.max().item(), 2 * want);
    EXPECT_EQ(kept.neg().max().item(), -2 * want);
  }
}
#endif  // CHORUS_WITH_CUDA

// Where the copy engines do not apply (CPU devices) they take nothing, and
// the caller's all_reduce_sum_after sums in order.
TEST(Comm, CopyEnginesTakeNothingOnCpuDevices) {
  std::vector<Tensor> bufs;
  std::vector<Event> ready;
  std::vector<float> want(37, 0.f);
  for (int i = 0; i < 3; ++i) {
    const auto v = random_vector(37, 500 + static_cast<uint32_t>(i));
    for (size_t k = 0; k < v.size(); ++k) want[k] += v[k];
    bufs.push_back(on(v, cpu_device(i)));
    ready.emplace_back(cpu_device(i), /*timing=*/false);
    ready.back().record();
  }
  EXPECT_FALSE(copy_engine_all_reduce_sum_after(bufs, ready));
  all_reduce_sum_after(bufs, ready);
  for (int i = 0; i < 3; ++i) {
    comm_join(cpu_device(i));
    EXPECT_EQ(bufs[static_cast<size_t>(i)].to_vector<float>(), want) << "cpu:" << i;
  }
}


// all_reduce_sum_each_after (Note [Gradients summed where they are] in
// data_parallel/reducer.h): every buffer of every tensor becomes the sum of that
// tensor's buffers, checked against the host (in device order: exact on CPU
// devices; NCCL rounds each element's sum once per rank for two GPUs and
// within float rounding otherwise); a channels-last tensor keeps its layout.
void check_each(const std::vector<Device>& devices, double tol) {
  SCOPED_TRACE(std::to_string(devices.size()) + " devices, first " + devices[0].str());
  struct Spec {
    Shape sizes;
    DType dtype;
    bool channels_last;
  };
  const std::vector<Spec> specs{{{(int64_t{1} << 16) + 3}, kFloat32, false},
                                {{3, 5, 4, 2}, kFloat32, true},
                                {{1}, kFloat32, false},
                                {{129}, kBFloat16, false},
                                {{0}, kFloat32, false}};
  std::vector<std::vector<Tensor>> bufs(specs.size());
  std::vector<std::vector<float>> want(specs.size());
  for (size_t t = 0; t < specs.size(); ++t) {
    const int64_t n = numel_of(specs[t].sizes);
    want[t].assign(static_cast<size_t>(n), 0.f);
    for (size_t i = 0; i < devices.size(); ++i) {
      Tensor b = on(random_vector(n, 700 + static_cast<uint32_t>(10 * t + i)), devices[i], specs[t].dtype)
                     .reshape(specs[t].sizes);
      if (specs[t].channels_last) b = to_channels_last(b);
      b.mul_(static_cast<double>(i + 1));  // written by a kernel just before the event
      const std::vector<float> v = b.contiguous().to(kFloat32).to_vector<float>();
      for (size_t k = 0; k < v.size(); ++k) want[t][k] += v[k];
      bufs[t].push_back(b);
    }
  }
  std::vector<Event> ready;
  for (const Device& d : devices) {
    ready.emplace_back(d, /*timing=*/false);
    ready.back().record();
  }
  all_reduce_sum_each_after(bufs, ready);
  for (const Device& d : devices) comm_join(d);
  for (size_t t = 0; t < specs.size(); ++t) {
    SCOPED_TRACE("tensor " + std::to_string(t) + " (" + dtype_name(specs[t].dtype) + ")");
    double scale = 1e-12;
    for (float w : want[t]) scale = std::max(scale, static_cast<double>(std::abs(w)));
    const double tol_t = specs[t].dtype == kBFloat16 ? 1e-2 : tol;
    for (size_t i = 0; i < devices.size(); ++i) {
      EXPECT_EQ(is_channels_last(bufs[t][i]), specs[t].channels_last) << devices[i].str();
      const std::vector<float> got = bufs[t][i].contiguous().to(kFloat32).to_vector<float>();
      ASSERT_EQ(got.size(), want[t].size());
      double err = 0;
      for (size_t k = 0; k < got.size(); ++k) err = std::max(err, std::abs(static_cast<double>(got[k]) - want[t][k]));
      EXPECT_LE(err / scale, tol_t) << devices[i].str();
    }
  }
}

TEST(Comm, AllReduceEachSumsEveryTensorOnCpuDevices) {
  check_each({cpu_device(0), cpu_device(1), cpu_device(2)}, 1e-6);
  check_each({cpu_device(2), cpu_device(0)}, 1e-6);
  check_each({cpu_device(1)}, 0);  // one device: nothing to add
}

TEST(Comm, AllReduceEachBadArgumentsAreValueErrors) {
  Tensor a = zeros({4, 4}, cpu_device(0)), b = zeros({4, 4}, cpu_device(1));
  Event e0(cpu_device(0)), e1(cpu_device(1));
  EXPECT_TRUE(test::throws_naming([&] { all_reduce_sum_each_after({{a, b}}, {e0}); },
                                    {"all_reduce_sum_each_after", "1 events", "2 devices"}));
  EXPECT_TRUE(test::throws_naming([&] { all_reduce_sum_each_after({{a, b}, {a}}, {e0, e1}); },
                                    {"all_reduce_sum_each_after", "tensor 1 has 1 buffers"}));
  EXPECT_TRUE(test::throws_naming([&] { all_reduce_sum_each_after({{a, b}, {b, a}}, {e0, e1}); },
                                    {"all_reduce_sum_each_after", "tensor 1", "cpu:1", "cpu:0"}));
  EXPECT_TRUE(test::throws_naming([&] { all_reduce_sum_each_after({{a.narrow(1, 0, 2), b.narrow(1, 0, 2)}}, {e0, e1}); },
                                    {"all_reduce_sum_each_after", "not dense"}));
  EXPECT_TRUE(test::throws_naming([&] { all_reduce_sum_each_after({{a, b.t().contiguous().t()}}, {e0, e1}); },
                                    {"all_reduce_sum_each_after", "strides"}));
  EXPECT_TRUE(test::throws_naming([&] { all_reduce_sum_each_after({{a, b}}, {e1, e0}); },
                                    {"all_reduce_sum_each_after", "event of device 0", "cpu:1"}));
  EXPECT_TRUE(test::throws_naming([&] { all_reduce_sum_each_after({{a, zeros({4, 4}, cpu_device(0))}}, {e0, e0}); },
                                    {"all_reduce_sum_each_after", "once"}));
}

#ifdef CHORUS_WITH_CUDA
TEST(Comm, AllReduceEachSumsEveryTensorOnGpus_MultiCUDA) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  const std::vector<Device> gpus = all_gpus();
  check_each(gpus, 1e-6);
  check_each({gpus[1], gpus[0]}, 1e-6);
  synchronize();
}

// Buffers dropped right after the call are not reused while NCCL still
// reads or writes them (they are named on the communication streams).
TEST(Comm, AllReduceEachKeepsBuffersUntilJoined_MultiCUDA) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  const std::vector<Device> gpus = all_gpus();
  const int64_t n = (int64_t{1} << 23) + 5;
  for (int iter = 0; iter < 3; ++iter) {
    std::vector<std::vector<Tensor>> bufs(2);
    std::vector<Event> ready;
    double want = 0;
    for (size_t i = 0; i < gpus.size(); ++i) {
      for (auto& b : bufs) {
        b.push_back(full({n}, 1.0, TensorOptions(kFloat32, gpus[i])));
        b.back().mul_(static_cast<double>(i + 2));
      }
      want += static_cast<double>(i + 2);
      ready.emplace_back(gpus[i], /*timing=*/false);
      ready.back().record();
    }
    all_reduce_sum_each_after(bufs, ready);
    Tensor kept = bufs[1][0];
    bufs.clear();
    std::vector<Tensor> scribble;
    for (size_t i = 0; i < gpus.size(); ++i)
      for (int k = 0; k < 2; ++k) scribble.push_back(full({n}, -1000.0, TensorOptions(kFloat32, gpus[i])));
    comm_join(gpus[0]);
    kept.add_(kept, 1.0);
    EXPECT_EQ(kept.max().item(), 2 * want);
    EXPECT_EQ(kept.neg().max().item(), -2 * want);
  }
}
#endif  // CHORUS_WITH_CUDA

}  // namespace
}  // namespace chorus::ops
