// parallel::DeviceThreads on logical CPU devices: each task runs on its
// device's thread under the caller's thread-local state (grad mode, autocast),
// and leaves the worker's own state as it was.
#include <gtest/gtest.h>

#include <chorus/autograd/autocast.h>
#include <chorus/autograd/grad_mode.h>
#include <chorus/chorus.h>
#include <chorus/parallel/device_threads.h>

#include <functional>
#include <optional>
#include <thread>
#include <vector>

#include "testing/devices.h"

namespace chorus::parallel {
namespace {

using test::cpus;

struct Seen {
  std::optional<DType> autocast;
  bool grad = true;
  Device device;
  std::thread::id thread;
};

std::vector<std::function<void()>> probes(std::vector<Seen>* seen) {
  std::vector<std::function<void()>> tasks;
  for (size_t i = 0; i < seen->size(); ++i)
    tasks.push_back([seen, i] {
      (*seen)[i] = {current_autocast(), grad_enabled(), current_device(), std::this_thread::get_id()};
    });
  return tasks;
}

TEST(Autocast, CurrentAutocastFollowsTheGuard) {
  EXPECT_FALSE(current_autocast().has_value());
  {
    AutocastGuard on(kBFloat16);
    EXPECT_EQ(current_autocast(), std::optional<DType>(kBFloat16));
    {
      AutocastGuard off(std::nullopt);
      EXPECT_FALSE(current_autocast().has_value());
    }
    EXPECT_EQ(current_autocast(), std::optional<DType>(kBFloat16));
  }
  EXPECT_FALSE(current_autocast().has_value());
}

TEST(DeviceThreads, TasksRunUnderTheCallersAutocastAndGradMode) {
  DeviceThreads threads(cpus(3));
  std::vector<Seen> seen(3);
  {
    AutocastGuard cast(kBFloat16);
    NoGradGuard no_grad;
    threads.run(probes(&seen));
  }
  for (size_t i = 0; i < seen.size(); ++i) {
    EXPECT_EQ(seen[i].autocast, std::optional<DType>(kBFloat16)) << "task " << i;
    EXPECT_FALSE(seen[i].grad) << "task " << i;
    EXPECT_EQ(seen[i].device, cpu_device(static_cast<int>(i)));
    EXPECT_NE(seen[i].thread, std::this_thread::get_id());
  }
  // The workers keep none of it: the next run sees the caller's state again.
  threads.run(probes(&seen));
  for (size_t i = 0; i < seen.size(); ++i) {
    EXPECT_FALSE(seen[i].autocast.has_value()) << "task " << i;
    EXPECT_TRUE(seen[i].grad) << "task " << i;
  }
  {
    AutocastGuard cast(kFloat16);
    threads.run(probes(&seen));
  }
  for (const Seen& s : seen) EXPECT_EQ(s.autocast, std::optional<DType>(kFloat16));
}

TEST(DeviceThreads, AFailingTaskNamesItsDeviceAndTheOthersStillRun) {
  DeviceThreads threads(cpus(3));
  std::vector<int> ran(3, 0);
  std::vector<std::function<void()>> tasks;
  for (int i = 0; i < 3; ++i)
    tasks.push_back([&ran, i] {
      ran[static_cast<size_t>(i)] = 1;
      if (i == 1) CHORUS_THROW(ValueError, "task one broke");
    });
  try {
    NoGradGuard no_grad;
    AutocastGuard cast(kBFloat16);
    threads.run(tasks);
    FAIL() << "expected chorus::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cpu:1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("task one broke"), std::string::npos) << e.what();
  }
  EXPECT_EQ(ran, (std::vector<int>{1, 1, 1}));
  // Grad mode and autocast were restored on the failing worker too.
  std::vector<Seen> seen(3);
  threads.run(probes(&seen));
  for (const Seen& s : seen) {
    EXPECT_TRUE(s.grad);
    EXPECT_FALSE(s.autocast.has_value());
  }
}

}  // namespace
}  // namespace chorus::parallel
