// Device names, device lists and the thread's current device.
#include <gtest/gtest.h>

#include <string>
#include <thread>

#include <chorus/chorus.h>

#include "testing/expect_error.h"

namespace chorus {
namespace {

using test::throws_naming;

TEST(Device, ParsesNames) {
  Device cpu("cpu");
  EXPECT_TRUE(cpu.is_cpu());
  EXPECT_EQ(cpu.index, 0);
  Device cpu3("cpu:3");
  EXPECT_EQ(cpu3.type, DeviceType::CPU);
  EXPECT_EQ(cpu3.index, 3);
  Device cuda1("cuda:1");  // parsing does not need the GPU to exist
  EXPECT_TRUE(cuda1.is_cuda());
  EXPECT_EQ(cuda1.index, 1);
  EXPECT_EQ(Device("cuda"), cuda_device(0));
  EXPECT_EQ(Device("cpu:12"), cpu_device(12));
}

TEST(Device, PrintsCanonicalNames) {
  EXPECT_EQ(Device("cpu").str(), "cpu:0");
  EXPECT_EQ(Device("cpu:3").str(), "cpu:3");
  EXPECT_EQ(Device("cuda:1").str(), "cuda:1");
  std::ostringstream os;
  os << Device("cpu:2");
  EXPECT_EQ(os.str(), "cpu:2");
  EXPECT_EQ(Device(Device("cuda:7").str()), cuda_device(7));  // round trip
}

TEST(Device, ComparesAndHashes) {
  EXPECT_EQ(Device("cpu:1"), cpu_device(1));
  EXPECT_NE(Device("cpu:1"), Device("cuda:1"));
  EXPECT_NE(Device("cpu:1"), Device("cpu:2"));
  EXPECT_TRUE(Device("cpu:1") < Device("cpu:2"));
  EXPECT_TRUE(Device("cpu:5") < Device("cuda:0"));
  EXPECT_EQ(std::hash<Device>()(Device("cpu:1")), std::hash<Device>()(cpu_device(1)));
  EXPECT_NE(std::hash<Device>()(Device("cpu:1")), std::hash<Device>()(Device("cuda:1")));
}

TEST(Device, BadNamesThrowValueErrorNamingTheText) {
  for (const char* bad : {"tpu", "gpu0", "cpu:", "cpu:x", "cpu:-1", "cuda:1:2", "CPU", "cpu 1", "cpu:1a"}) {
    SCOPED_TRACE(bad);
    EXPECT_TRUE(throws_naming([&] { Device d(bad); (void)d; }, {std::string("'") + bad + "'"}));
  }
  EXPECT_TRUE(throws_naming([] { Device d(""); (void)d; }, {"''"}));
}

TEST(Device, CheckDeviceRejectsMissingDevices) {
  EXPECT_NO_THROW(check_device(Device("cpu:0")));
  EXPECT_NO_THROW(check_device(cpu_device(cpu_device_count() - 1)));
  EXPECT_TRUE(throws_naming([] { check_device(cpu_device(cpu_device_count())); },
                     {cpu_device(cpu_device_count()).str(), "does not exist"}));
  if (cuda_device_count() == 0) {
    EXPECT_THROW(check_device(Device("cuda:0")), DeviceError);
  } else {
    EXPECT_THROW(check_device(cuda_device(cuda_device_count())), DeviceError);
  }
  EXPECT_GE(cpu_device_count(), 2);  // the multi-device tests need cpu:0 and cpu:1
}

// Issue 15: an invalid CHORUS_CPU_DEVICES silently meant 8.
TEST(Device, InvalidCpuDeviceCountIsAnError) {
  EXPECT_EQ(detail::parse_cpu_device_count(nullptr), 8);
  EXPECT_EQ(detail::parse_cpu_device_count("3"), 3);
  EXPECT_EQ(detail::parse_cpu_device_count("1024"), 1024);
  for (const char* bad : {"", "abc", "0", "-2", "4x", " 4", "1025", "99999999999", "2.5"}) {
    SCOPED_TRACE(bad);
    EXPECT_TRUE(throws_naming([&] { detail::parse_cpu_device_count(bad); },
                              {std::string("CHORUS_CPU_DEVICES='") + bad + "'", "from 1 to 1024"}));
  }
}

TEST(Device, ParseDevicesLists) {
  std::vector<Device> two = parse_devices("cpu:0,cpu:1");
  ASSERT_EQ(two.size(), 2u);
  EXPECT_EQ(two[0], cpu_device(0));
  EXPECT_EQ(two[1], cpu_device(1));
  std::vector<Device> one = parse_devices("cpu");
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0], cpu_device(0));
  std::vector<Device> order = parse_devices("cpu:3,cpu:1,cpu:2");
  EXPECT_EQ(order, (std::vector<Device>{cpu_device(3), cpu_device(1), cpu_device(2)}));
  std::vector<Device> all = parse_devices("all");
  if (cuda_device_count() == 0) {
    EXPECT_EQ(all, std::vector<Device>{cpu_device(0)});
  } else {
    EXPECT_EQ(static_cast<int>(all.size()), cuda_device_count());
    EXPECT_TRUE(all[0].is_cuda());
  }
}

TEST(Device, ParseDevicesRejectsDuplicatesAndEmptyLists) {
  EXPECT_TRUE(throws_naming([] { parse_devices("cpu:0,cpu:0"); }, {"cpu:0", "twice"}));
  EXPECT_TRUE(throws_naming([] { parse_devices("cpu:1,cpu,cpu:1"); }, {"cpu:1", "twice"}));
  EXPECT_TRUE(throws_naming([] { parse_devices("cpu,cpu:0"); }, {"cpu:0", "twice"}));  // same device, two spellings
  EXPECT_TRUE(throws_naming([] { parse_devices(""); }, {"empty"}));
  EXPECT_TRUE(throws_naming([] { parse_devices("cpu:0,"); }, {"empty"}));
  EXPECT_TRUE(throws_naming([] { parse_devices(",cpu:0"); }, {"empty"}));
  EXPECT_TRUE(throws_naming([] { parse_devices("cpu:0,,cpu:1"); }, {"empty"}));
  EXPECT_TRUE(throws_naming([] { parse_devices("cpu:0,npu:1"); }, {"npu:1"}));
  EXPECT_TRUE(throws_naming([] { parse_devices("cpu:999"); }, {"cpu:999"}));
}

TEST(Device, DeviceGuardSetsAndRestores) {
  ASSERT_EQ(current_device(), cpu_device(0));
  {
    DeviceGuard g(Device("cpu:2"));
    EXPECT_EQ(current_device(), cpu_device(2));
    EXPECT_EQ(zeros({2}).device(), cpu_device(2));  // factories follow the current device
    EXPECT_EQ(randn({2}).device(), cpu_device(2));
    {
      DeviceGuard inner(Device("cpu:1"));
      EXPECT_EQ(current_device(), cpu_device(1));
      EXPECT_EQ(ones({1}).device(), cpu_device(1));
      EXPECT_EQ(zeros({1}, {kFloat32, cpu_device(3)}).device(), cpu_device(3));  // explicit wins
    }
    EXPECT_EQ(current_device(), cpu_device(2));
  }
  EXPECT_EQ(current_device(), cpu_device(0));
}

TEST(Device, DeviceGuardOnAMissingDeviceThrowsAndChangesNothing) {
  EXPECT_THROW(DeviceGuard g(cpu_device(cpu_device_count() + 5)), ValueError);
  EXPECT_EQ(current_device(), cpu_device(0));
}

TEST(Device, CurrentDeviceIsPerThread) {
  DeviceGuard g(Device("cpu:3"));
  Device seen_in_thread;
  std::thread t([&] { seen_in_thread = current_device(); });
  t.join();
  EXPECT_EQ(seen_in_thread, cpu_device(0));
  EXPECT_EQ(current_device(), cpu_device(3));
}

}  // namespace
}  // namespace chorus
