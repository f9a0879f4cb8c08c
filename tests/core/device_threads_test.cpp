// core::DeviceThreadPool (Note [Device thread pool]): tasks run concurrently
// on threads of their devices; threads are reused across runs (the backward
// engine and DataParallel no longer create threads per step); overlapping and
// nested runs cannot deadlock; errors come back per task.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>

#include <chorus/chorus.h>
#include <chorus/autograd/node.h>
#include <chorus/core/device_threads.h>
#include <chorus/ops/copy.h>

namespace chorus {
namespace {

// Waits until `n` parties have arrived, or fails after a few seconds (instead
// of hanging the test) when the tasks do not run at the same time.
struct Rendezvous {
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  bool arrive_and_wait(int n) {
    std::unique_lock<std::mutex> lk(mu);
    ++arrived;
    cv.notify_all();
    return cv.wait_for(lk, std::chrono::seconds(10), [&] { return arrived >= n; });
  }
};

TEST(DeviceThreadPool, TasksRunConcurrentlyOnTheirDevices) {
  DeviceThreadPool pool;
  const std::vector<Device> devs = {cpu_device(0), cpu_device(1), cpu_device(2)};
  Rendezvous all;
  std::vector<Device> seen(3);
  std::vector<char> together(3, 0);
  std::vector<std::function<void()>> tasks;
  for (size_t i = 0; i < 3; ++i)
    tasks.push_back([&, i] {
      seen[i] = current_device();
      together[i] = all.arrive_and_wait(3);  // only possible if all three run at once
    });
  auto errors = pool.run(devs, tasks);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_FALSE(errors[i]);
    EXPECT_EQ(seen[i], devs[i]);
    EXPECT_TRUE(together[i]) << "task " << i << " did not run concurrently with the others";
  }
}

TEST(DeviceThreadPool, ThreadsAreReusedAcrossRuns) {
  DeviceThreadPool pool;
  const std::vector<Device> devs = {cpu_device(0), cpu_device(1)};
  std::set<std::thread::id> ids;
  std::mutex mu;
  auto probe = [&] {
    std::lock_guard<std::mutex> lk(mu);
    ids.insert(std::this_thread::get_id());
  };
  for (int r = 0; r < 50; ++r) pool.run(devs, {probe, probe});
  EXPECT_EQ(pool.num_threads(), 2u);
  EXPECT_EQ(ids.size(), 2u) << "the same two threads serve every run";
}

TEST(DeviceThreadPool, ErrorsComeBackPerTask) {
  DeviceThreadPool pool;
  auto errors = pool.run({cpu_device(0), cpu_device(1)},
                         {[] {}, [] { throw std::runtime_error("boom on cpu:1"); }});
  EXPECT_FALSE(errors[0]);
  ASSERT_TRUE(errors[1]);
  try {
    std::rethrow_exception(errors[1]);
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "boom on cpu:1");
  }
  // The pool is still usable, with the same threads.
  EXPECT_FALSE(pool.run({cpu_device(1)}, {[] {}})[0]);
  EXPECT_EQ(pool.num_threads(), 2u);
}

TEST(DeviceThreadPool, NestedAndOverlappingRunsDoNotDeadlock) {
  DeviceThreadPool pool;
  const std::vector<Device> devs = {cpu_device(0), cpu_device(1)};
  // A task that itself runs work on both devices (a backward inside a replica).
  std::atomic<int> inner{0};
  auto nested = [&] { pool.run(devs, {[&] { ++inner; }, [&] { ++inner; }}); };
  pool.run(devs, {nested, nested});
  EXPECT_EQ(inner.load(), 4);
  // Two user threads whose runs wait for each other: with one fixed thread
  // per device, each would hold a device the other needs.
  Rendezvous both;
  std::atomic<int> met{0};
  auto cross = [&] { met += both.arrive_and_wait(4); };
  std::thread a([&] { pool.run(devs, {cross, cross}); });
  std::thread b([&] { pool.run({devs[1], devs[0]}, {cross, cross}); });
  a.join();
  b.join();
  EXPECT_EQ(met.load(), 4);
}

// The engine's multi-device backward takes its threads from the global pool:
// many backwards, no new threads after the first.
TEST(DeviceThreadPool, MultiDeviceBackwardReusesPoolThreads) {
  Tensor w0 = randn({8, 8}, {kFloat32, cpu_device(0)});
  Tensor w1 = randn({8, 8}, {kFloat32, cpu_device(1)});
  w0.set_requires_grad(true);
  w1.set_requires_grad(true);
  auto step = [&] {
    Tensor x = randn({4, 8}, {kFloat32, cpu_device(0)});
    Tensor h = x.matmul(w0).relu();
    Tensor y = h.to(cpu_device(1)).matmul(w1);
    y.sum().backward();
  };
  step();
  const size_t after_first = DeviceThreadPool::global().num_threads();
  EXPECT_GE(after_first, 2u);
  for (int i = 0; i < 20; ++i) step();
  EXPECT_EQ(DeviceThreadPool::global().num_threads(), after_first);
  EXPECT_TRUE(w0.grad().defined());
  EXPECT_TRUE(w1.grad().defined());
}

// A node that fails on one device's pool thread: the exception reaches the
// caller of backward(), and the pool's threads serve the next backward.
TEST(DeviceThreadPool, AnErrorInAMultiDeviceBackwardReachesTheCaller) {
  Tensor w0 = randn({8, 8}, {kFloat32, cpu_device(0)});
  w0.set_requires_grad(true);
  auto run = [&](bool fail) {
    Tensor h = randn({4, 8}, {kFloat32, cpu_device(0)}).matmul(w0);
    Tensor h1 = h.to(cpu_device(1));
    Tensor y = autograd::record("Boom", ops::clone(h1), {h1}, [fail](const TensorList& g) {
      if (fail) throw ValueError("boom on cpu:1");
      return TensorList{g[0]};
    });
    y.sum().backward();
  };
  run(false);
  const size_t threads = DeviceThreadPool::global().num_threads();
  w0.zero_grad();
  try {
    run(true);
    FAIL() << "expected the node's error";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("boom on cpu:1"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(w0.grad().defined()) << "the failed backward stopped before the leaf";
  run(false);
  EXPECT_TRUE(w0.grad().defined());
  EXPECT_EQ(DeviceThreadPool::global().num_threads(), threads) << "no thread lost or added";
}

// Every task issues to the caller's current stream of every device of the
// run, not only of its own (a DataParallel replica also copies from the
// inputs' device; inside a CUDA graph capture, work on any other stream would
// leave the graph), and the pool's threads go back to their own streams.
TEST(DeviceThreadPool, EveryTaskIssuesToTheCallersStreamsOfEveryDevice_CUDA) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "no CUDA device";
  DeviceThreadPool pool;
  const Device g = cuda_device(0);
  const std::vector<Device> devs = {g, cpu_device(1)};
  const Stream mine = Stream::create(g);
  std::vector<char> on_mine(2, 0);
  std::vector<std::function<void()>> tasks;
  for (size_t i = 0; i < 2; ++i) tasks.push_back([&, i] { on_mine[i] = Stream::current(g) == mine; });
  {
    StreamGuard guard(mine);
    for (auto& e : pool.run(devs, tasks)) EXPECT_FALSE(e);
  }
  EXPECT_TRUE(on_mine[0]) << "the task of cuda:0 did not issue to the caller's stream";
  EXPECT_TRUE(on_mine[1]) << "the task of cpu:1 did not issue to the caller's stream of cuda:0";
  for (auto& e : pool.run(devs, tasks)) EXPECT_FALSE(e);  // no guard: the threads' own streams again
  EXPECT_FALSE(on_mine[0]);
  EXPECT_FALSE(on_mine[1]);
}

}  // namespace
}  // namespace chorus
