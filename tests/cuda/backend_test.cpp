// The CUDA backend: copies in every direction (checked byte for byte against
// the host data), the stream-ordered allocator (accounting, freeing memory
// that another stream still reads, recovery from out-of-memory), streams and
// events. Skips visibly where there is no GPU.
#ifdef CHORUS_WITH_CUDA

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/core/tensor.h"
#include "chorus/cuda/kernels/kernels.h"

namespace chorus {
namespace {

const Device kGpu = cuda_device(0);
const Device kHost = cpu_device(0);

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<uint8_t> v(n);
  for (uint8_t& b : v) b = static_cast<uint8_t>(gen());
  return v;
}

// The device bytes at ptr, read back through a device-to-host copy.
std::vector<uint8_t> read_back(const void* ptr, Device dev, size_t n) {
  std::vector<uint8_t> out(n);
  backend(dev).copy(out.data(), kHost, ptr, dev, n);
  return out;
}

std::vector<float> read_floats(const Tensor& t) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  backend(t.device()).copy(out.data(), kHost, t.raw_data(), t.device(), t.nbytes());
  return out;
}

int64_t count_not_equal(const std::vector<float>& v, float want) {
  return std::count_if(v.begin(), v.end(), [&](float x) { return x != want; });
}

TEST(CudaBackend, DeviceCountAndName_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  EXPECT_EQ(backend(kGpu).device_count(), cuda_device_count());
  const std::string name = backend(kGpu).device_name(kGpu);
  EXPECT_FALSE(name.empty());
  EXPECT_NE(name.find("GiB"), std::string::npos) << name;
  EXPECT_THROW(backend(kGpu).allocate(16, cuda_device(cuda_device_count())), DeviceError);
}

TEST(CudaBackend, CopiesInEveryDirection_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  DeviceBackend& be = backend(kGpu);
  const size_t n = (1 << 20) + 3;  // odd: not a multiple of any vector width
  const std::vector<uint8_t> want = random_bytes(n, 1);
  void* a = be.allocate(n, kGpu);
  void* b = be.allocate(n, kGpu);
  {
    // The source may be overwritten (or freed) as soon as copy() returns.
    std::vector<uint8_t> src = want;
    be.copy(a, kGpu, src.data(), kHost, n);
    std::fill(src.begin(), src.end(), uint8_t{0xAB});
  }
  be.copy(b, kGpu, a, kGpu, n);
  EXPECT_EQ(read_back(b, kGpu, n), want);
  // A device-to-device copy at an odd offset.
  be.copy(static_cast<char*>(b) + 1, kGpu, a, kGpu, n - 1);
  const std::vector<uint8_t> shifted = read_back(b, kGpu, n);
  EXPECT_EQ(shifted[0], want[0]);
  EXPECT_TRUE(std::equal(want.begin(), want.end() - 1, shifted.begin() + 1));
  be.deallocate(a, kGpu);
  be.deallocate(b, kGpu);
}

TEST(CudaBackend, LargeHostToDeviceCopyGoesThroughStagingInChunks_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  DeviceBackend& be = backend(kGpu);
  const size_t n = (size_t{80} << 20) + 7;  // more than two 32 MiB staging chunks
  const std::vector<uint8_t> want = random_bytes(n, 2);
  void* d = be.allocate(n, kGpu);
  std::vector<uint8_t> src = want;
  be.copy(d, kGpu, src.data(), kHost, n);
  std::fill(src.begin(), src.end(), uint8_t{0});
  // Copies from small sources right after reuse the same staging buffers.
  std::vector<uint8_t> small = random_bytes(100, 3);
  void* e = be.allocate(small.size(), kGpu);
  be.copy(e, kGpu, small.data(), kHost, small.size());
  EXPECT_EQ(read_back(d, kGpu, n), want);
  EXPECT_EQ(read_back(e, kGpu, small.size()), small);
  be.deallocate(d, kGpu);
  be.deallocate(e, kGpu);
}

TEST(CudaBackend, DeviceToHostCopyWaitsForPendingKernels_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  Tensor t = detail::empty_tensor({1 << 24}, kFloat32, kGpu);
  for (int i = 1; i <= 5; ++i) cuda::fill(t, static_cast<double>(i));  // queued, not waited for
  EXPECT_EQ(count_not_equal(read_floats(t), 5.0f), 0);
}

TEST(CudaBackend, CountsBytesInUseAndPeak_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  DeviceBackend& be = backend(kGpu);
  const size_t base = be.bytes_in_use(kGpu);
  const size_t n = size_t{3} << 20;
  void* p = be.allocate(n, kGpu);
  EXPECT_EQ(be.bytes_in_use(kGpu), base + n);
  EXPECT_GE(be.peak_bytes(kGpu), base + n);
  be.deallocate(p, kGpu);
  EXPECT_EQ(be.bytes_in_use(kGpu), base);
  be.reset_peak_bytes(kGpu);
  EXPECT_EQ(be.peak_bytes(kGpu), base);
  EXPECT_EQ(be.allocate(0, kGpu), nullptr);
}

TEST(CudaBackend, OutOfMemoryThrowsAndTheDeviceStaysUsable_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  DeviceBackend& be = backend(kGpu);
  const size_t before = be.bytes_in_use(kGpu);
  try {
    be.allocate(size_t{1} << 50, kGpu);  // 1 PiB
    FAIL() << "allocating 1 PiB succeeded";
  } catch (const OutOfMemoryError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("cuda:0"), std::string::npos) << msg;
    EXPECT_NE(msg.find("1.00 PiB"), std::string::npos) << msg;
    EXPECT_NE(msg.find("in use"), std::string::npos) << msg;
  }
  EXPECT_EQ(be.bytes_in_use(kGpu), before);
  Tensor t = detail::empty_tensor({1 << 20}, kFloat32, kGpu);
  cuda::fill(t, 1.5);
  EXPECT_EQ(count_not_equal(read_floats(t), 1.5f), 0);
}

// Memory freed on one stream while another still reads it must not be handed
// out again before the reader is done. The reading stream is kept busy first,
// so without the allocator's event wait the new owner's writes would land
// before the read.
TEST(CudaBackend, MemoryReadByAnotherStreamIsNotReusedEarly_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  DeviceBackend& be = backend(kGpu);
  StreamHandle s1 = be.create_stream(kGpu), s2 = be.create_stream(kGpu);
  const int64_t n = 1 << 22;

  be.set_current_stream(kGpu, s1);
  Tensor a = detail::empty_tensor({n}, kFloat32, kGpu);  // allocated on s1
  cuda::fill(a, 3.0);
  EventHandle filled = be.create_event(kGpu, false);
  be.record_event(kGpu, filled, s1);
  be.stream_wait_event(kGpu, s2, filled);

  be.set_current_stream(kGpu, s2);
  Tensor busy = detail::empty_tensor({1 << 26}, kFloat32, kGpu);
  for (int i = 0; i < 30; ++i) cuda::fill(busy, i);  // keeps s2 busy for a while
  Tensor b = detail::empty_tensor({n}, kFloat32, kGpu);
  be.record_use(a.raw_data(), kGpu, kGpu);  // s2 reads a
  cuda::copy(a, b);

  be.set_current_stream(kGpu, s1);
  a = Tensor();  // freed on s1 while s2 may not have read it yet
  Tensor c = detail::empty_tensor({n}, kFloat32, kGpu);
  cuda::fill(c, 7.0);

  // Destroying s2 while b (allocated on it) is alive must keep b's free safe.
  be.set_current_stream(kGpu, nullptr);
  be.synchronize(kGpu);
  be.destroy_stream(kGpu, s2);
  EXPECT_EQ(count_not_equal(read_floats(b), 3.0f), 0);
  EXPECT_EQ(count_not_equal(read_floats(c), 7.0f), 0);
  b = Tensor();
  busy = Tensor();
  c = Tensor();
  be.destroy_event(kGpu, filled);
  be.destroy_stream(kGpu, s1);
  be.synchronize(kGpu);
}

// The same, with the two call orders record_use() must accept (before the
// read is enqueued, and after it, as the copies do) and with the reading
// stream destroyed before the block is freed: the free must still wait for the
// read.
TEST(CudaBackend, RecordUseCoversWorkEnqueuedBeforeOrAfterIt_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  DeviceBackend& be = backend(kGpu);
  const int64_t n = 1 << 22;
  for (int variant = 0; variant < 4; ++variant) {
    SCOPED_TRACE(variant);
    const bool record_after = variant & 1, destroy_reader = variant & 2;
    StreamHandle s1 = be.create_stream(kGpu), s2 = be.create_stream(kGpu);

    be.set_current_stream(kGpu, s1);
    Tensor a = detail::empty_tensor({n}, kFloat32, kGpu);
    cuda::fill(a, 3.0);
    EventHandle filled = be.create_event(kGpu, false);
    be.record_event(kGpu, filled, s1);
    be.stream_wait_event(kGpu, s2, filled);

    be.set_current_stream(kGpu, s2);
    Tensor busy = detail::empty_tensor({1 << 26}, kFloat32, kGpu);
    for (int i = 0; i < 30; ++i) cuda::fill(busy, i);
    Tensor b = detail::empty_tensor({n}, kFloat32, kGpu);
    if (!record_after) be.record_use(a.raw_data(), kGpu, kGpu);
    cuda::copy(a, b);
    if (record_after) be.record_use(a.raw_data(), kGpu, kGpu);
    be.set_current_stream(kGpu, s1);
    if (destroy_reader) be.destroy_stream(kGpu, s2);  // its work still runs

    a = Tensor();
    Tensor c = detail::empty_tensor({n}, kFloat32, kGpu);
    cuda::fill(c, 7.0);

    be.set_current_stream(kGpu, nullptr);
    be.synchronize(kGpu);
    EXPECT_EQ(count_not_equal(read_floats(b), 3.0f), 0);
    EXPECT_EQ(count_not_equal(read_floats(c), 7.0f), 0);
    b = Tensor();
    busy = Tensor();
    c = Tensor();
    be.destroy_event(kGpu, filled);
    if (!destroy_reader) be.destroy_stream(kGpu, s2);
    be.destroy_stream(kGpu, s1);
    be.synchronize(kGpu);
  }
}

// Note [One default stream per device] (cuda/runtime/context.cpp): threads share the
// device's default stream; a chosen stream is per thread.
TEST(CudaBackend, CurrentStreamIsPerThreadAndNullRestoresTheDefault_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  DeviceBackend& be = backend(kGpu);
  StreamHandle mine = be.current_stream(kGpu);
  EXPECT_NE(mine, nullptr);  // a Chorus stream, not the legacy NULL stream
  EXPECT_EQ(be.current_stream(kGpu), mine);
  StreamHandle other = nullptr;
  std::thread([&] { other = backend(kGpu).current_stream(kGpu); }).join();
  EXPECT_EQ(other, mine);

  StreamHandle s = be.create_stream(kGpu);
  be.set_current_stream(kGpu, s);
  EXPECT_EQ(be.current_stream(kGpu), s);
  StreamHandle seen_by_other = nullptr;
  std::thread([&] { seen_by_other = backend(kGpu).current_stream(kGpu); }).join();
  EXPECT_EQ(seen_by_other, mine);  // the choice does not leak to other threads
  be.set_current_stream(kGpu, nullptr);
  EXPECT_EQ(be.current_stream(kGpu), mine);
  be.destroy_stream(kGpu, s);
}

TEST(CudaBackend, EventsOrderAndTimeWork_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  DeviceBackend& be = backend(kGpu);
  EventHandle start = be.create_event(kGpu, true), end = be.create_event(kGpu, true);
  Tensor t = detail::empty_tensor({1 << 24}, kFloat32, kGpu);
  be.record_event(kGpu, start, nullptr);
  for (int i = 0; i < 10; ++i) cuda::fill(t, i);
  be.record_event(kGpu, end, nullptr);
  be.synchronize_event(kGpu, end);
  EXPECT_TRUE(be.event_query(kGpu, end));
  EXPECT_GE(be.event_elapsed_ms(kGpu, start, end), 0.0f);

  // Work on a second stream waits for the event of the first.
  StreamHandle s = be.create_stream(kGpu);
  EventHandle ready = be.create_event(kGpu, false);
  cuda::fill(t, 4.0);
  be.record_event(kGpu, ready, nullptr);
  be.stream_wait_event(kGpu, s, ready);
  be.set_current_stream(kGpu, s);
  cuda::unary(UnaryOp::MulScalar, t, t, 2.0);
  be.synchronize_stream(kGpu, s);
  be.set_current_stream(kGpu, nullptr);
  EXPECT_EQ(count_not_equal(read_floats(t), 8.0f), 0);
  be.destroy_event(kGpu, start);
  be.destroy_event(kGpu, end);
  be.destroy_event(kGpu, ready);
  be.destroy_stream(kGpu, s);
}

TEST(CudaBackend, CopiesBetweenGpus_MultiCUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs 2 CUDA devices";
  const Device g0 = cuda_device(0), g1 = cuda_device(1);
  const int64_t n = (1 << 22) + 1;
  Tensor a = detail::empty_tensor({n}, kFloat32, g0);
  Tensor b = detail::empty_tensor({n}, kFloat32, g1);
  for (int i = 1; i <= 4; ++i) cuda::fill(a, i);  // pending on cuda:0 when the copy is issued
  backend(g1).copy(b.raw_data(), g1, a.raw_data(), g0, a.nbytes());
  a = Tensor();  // freed right away: the allocator keeps it until cuda:1 has read it
  EXPECT_EQ(count_not_equal(read_floats(b), 4.0f), 0);

  Tensor c = detail::empty_tensor({n}, kFloat32, g0);
  cuda::fill(b, 9.0);
  backend(g0).copy(c.raw_data(), g0, b.raw_data(), g1, b.nbytes());
  EXPECT_EQ(count_not_equal(read_floats(c), 9.0f), 0);
}

// A peer copy reads its source on the destination's stream: freeing the source
// on its own device must wait for that read even when the destination stream
// is busy and the memory is handed out again at once.
TEST(CudaBackend, PeerCopySourceIsNotReusedBeforeTheCopy_MultiCUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs 2 CUDA devices";
  const Device g0 = cuda_device(0), g1 = cuda_device(1);
  const int64_t n = 1 << 22;
  Tensor a = detail::empty_tensor({n}, kFloat32, g0);
  cuda::fill(a, 3.0);
  Tensor busy = detail::empty_tensor({1 << 26}, kFloat32, g1);
  for (int i = 0; i < 30; ++i) cuda::fill(busy, i);  // keeps cuda:1's stream busy
  Tensor b = a.to(g1);  // ops::to_device: copy_peer, then record_use again
  a = Tensor();
  Tensor c = detail::empty_tensor({n}, kFloat32, g0);
  cuda::fill(c, 7.0);
  EXPECT_EQ(count_not_equal(read_floats(b), 3.0f), 0);
  EXPECT_EQ(count_not_equal(read_floats(c), 7.0f), 0);
}

}  // namespace
}  // namespace chorus

#endif  // CHORUS_WITH_CUDA
