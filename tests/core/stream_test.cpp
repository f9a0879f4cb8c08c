// Streams, events and guards: the same code on a CPU device (synchronous) and,
// where present, a GPU.
#include <gtest/gtest.h>

#include <thread>

#include <chorus/chorus.h>

namespace chorus {
namespace {

void exercise(const Device& d) {
  Stream s = Stream::create(d);
  Event start(d), end(d);
  {
    StreamGuard g(s);
    EXPECT_EQ(Stream::current(d), s);
    start.record();
    Tensor a = randn({256, 256}, {kFloat32, d});
    Tensor b = matmul(a, a);
    end.record();
    Stream other = Stream::create(d);
    other.wait(end);  // work on `other` after this point follows b
    StreamGuard g2(other);
    Tensor c = b.add(b);
    other.synchronize();
    EXPECT_NEAR(c.sum().item(), 2 * b.sum().item(), 1e-2 * std::abs(b.sum().item()) + 1e-3);
  }
  end.synchronize();
  EXPECT_TRUE(end.query());
  EXPECT_GE(start.elapsed(end), 0.0f);
  // The guard restored the thread's default stream (CPU streams are all the
  // issuing thread itself, so only a GPU can tell them apart).
  if (d.is_cuda()) EXPECT_FALSE(Stream::current(d) == s);
}

TEST(Streams, EventsOrderAndTimeWorkOnCpu) { exercise(Device("cpu:1")); }

TEST(Streams, EventsOrderAndTimeWork_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  exercise(Device("cuda:0"));
}

TEST(Streams, ElapsedNeedsRecordedEvents) {
  Event a(Device("cpu")), b(Device("cpu"));
  EXPECT_THROW(a.elapsed(b), ValueError);
  EXPECT_THROW(Stream::create(Device("cpu:99")), ValueError);
}

TEST(Streams, SynchronizeAllAndOneDevice) {
  Tensor x = ones({8}, {kFloat32, Device("cpu:2")});
  synchronize();
  synchronize(Device("cpu:2"));
  EXPECT_DOUBLE_EQ(x.sum().item(), 8.0);
}

}  // namespace
}  // namespace chorus
