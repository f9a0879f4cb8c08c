// Device: a compute resource, written `cpu`, `cpu:1`, `cuda:0`.
//
// Several logical CPU devices (cpu:0..N-1) exist so that every multi-device
// code path (DataParallel, pipelines, cross-device copies) runs and is tested on
// a machine with no GPU. They share host memory; an op "on cpu:1" runs on the
// thread that issues it.
//
// A thread has a current device (set_device / DeviceGuard); factory functions
// without an explicit device use it. It starts as cpu:0.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace chorus {

enum class DeviceType : int8_t { CPU = 0, CUDA = 1 };

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;

  constexpr Device() = default;
  constexpr Device(DeviceType t, int i = 0) : type(t), index(i) {}
  // Parses "cpu", "cpu:2", "cuda", "cuda:1"; throws ValueError naming the text.
  explicit Device(const std::string& text);
  Device(const char* text) : Device(std::string(text)) {}

  bool is_cpu() const { return type == DeviceType::CPU; }
  bool is_cuda() const { return type == DeviceType::CUDA; }
  std::string str() const;
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
  bool operator<(const Device& o) const {
    return type != o.type ? type < o.type : index < o.index;
  }
};

inline Device cpu_device(int index = 0) { return Device(DeviceType::CPU, index); }
inline Device cuda_device(int index = 0) { return Device(DeviceType::CUDA, index); }

// Number of logical CPU devices (CHORUS_CPU_DEVICES, default 8). A value
// that is not a whole number from 1 to kMaxCpuDevices throws ValueError.
int cpu_device_count();
inline constexpr int kDefaultCpuDevices = 8;
inline constexpr int kMaxCpuDevices = 1024;
namespace detail {
// CHORUS_CPU_DEVICES' value (null: unset) as cpu_device_count reads it.
int parse_cpu_device_count(const char* env);
}  // namespace detail
// Number of CUDA devices visible (0 in a CPU-only build or without a GPU).
int cuda_device_count();
bool cuda_is_available();

// Throws ValueError (or DeviceError for a missing GPU) if `d` does not exist.
void check_device(const Device& d);

// Parses a comma-separated list ("cpu:0,cpu:1", "cuda:0,cuda:1", "all", "cpu").
// "all" means every GPU, or cpu:0 where there is none.
std::vector<Device> parse_devices(const std::string& text);

Device current_device();
void set_device(const Device& d);

// RAII: sets the current device, restores the previous one on destruction.
class DeviceGuard {
 public:
  explicit DeviceGuard(const Device& d);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  Device prev_;
};

std::ostream& operator<<(std::ostream& os, const Device& d);

}  // namespace chorus

template <>
struct std::hash<chorus::Device> {
  size_t operator()(const chorus::Device& d) const noexcept {
    return std::hash<int>()(static_cast<int>(d.type) * 1024 + d.index);
  }
};
