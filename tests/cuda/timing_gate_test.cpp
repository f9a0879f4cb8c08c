// Note [Timing behind a gate] (cuda/runtime/timing_gate.h): work issued behind a gate
// does not start until the gate opens, then runs; a gate never opened lets
// the stream go after its bound and says so; a gate destroyed unopened opens.
#ifdef CHORUS_WITH_CUDA

#include <gtest/gtest.h>

#include <chrono>
#include <thread>
#include <vector>

#include <chorus/chorus.h>
#include <chorus/cuda/runtime/context.h>
#include <chorus/cuda/runtime/timing_gate.h>

namespace chorus {
namespace {

TEST(CudaTimingGate, HoldsTheStreamUntilOpened_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const Device dev = cuda_device(0);
  Tensor a = randn({1 << 20}).to(dev);
  // Once before the gate: a kernel's first launch may load its module, which
  // waits for the running kernels (the spinning gate among them).
  add(a, a);
  synchronize(dev);
  Event done(dev);
  Tensor b;
  {
    cuda::StreamGate gate(cuda::current_stream(0));
    b = add(a, a);  // issued behind the gate
    done.record();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_FALSE(done.query()) << "the work behind a closed gate ran";
    gate.open();
    done.synchronize();
    EXPECT_FALSE(gate.expired());
  }
  std::vector<float> twice = a.to(cpu_device(0)).to_vector<float>();
  for (float& v : twice) v *= 2;  // a + a, exactly
  EXPECT_EQ(b.to(cpu_device(0)).to_vector<float>(), twice);
}

TEST(CudaTimingGate, AGateNeverOpenedLetsGoAfterItsBound_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const Device dev = cuda_device(0);
  Event done(dev);
  const auto t0 = std::chrono::steady_clock::now();
  cuda::StreamGate gate(cuda::current_stream(0));
  done.record();
  done.synchronize();  // returns only because the spin gives up
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_TRUE(gate.expired());
  EXPECT_GE(s, 0.4);
  EXPECT_LT(s, 5.0);
}

TEST(CudaTimingGate, AGateDestroyedUnopenedOpens_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const Device dev = cuda_device(0);
  Event done(dev);
  const auto t0 = std::chrono::steady_clock::now();
  { cuda::StreamGate gate(cuda::current_stream(0)); }
  done.record();
  done.synchronize();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 0.3);
}

// Concurrent gates (a pipeline's device threads each time their tasks):
// opening the newer gate leaves the older one closed.
TEST(CudaTimingGate, ConcurrentGatesOpenOnlyThemselves_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  const Device dev = cuda_device(0);
  Stream s1 = Stream::create(dev), s2 = Stream::create(dev);
  Event first(dev), second(dev);
  cuda::StreamGate older(static_cast<cudaStream_t>(s1.handle()));
  first.record(s1);
  cuda::StreamGate newer(static_cast<cudaStream_t>(s2.handle()));
  second.record(s2);
  newer.open();
  second.synchronize();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(first.query()) << "opening the newer gate opened the older one";
  older.open();
  first.synchronize();
  EXPECT_FALSE(older.expired());
  EXPECT_FALSE(newer.expired());
}

}  // namespace
}  // namespace chorus

#endif  // CHORUS_WITH_CUDA
