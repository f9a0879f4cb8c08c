#include "chorus/core/device.h"

#include <cstdlib>
#include <ostream>

#include "chorus/core/backend.h"
#include "chorus/core/env_switches.h"
#include "chorus/core/error.h"

namespace chorus {

namespace {
thread_local Device t_current_device = Device(DeviceType::CPU, 0);

bool parse_index(const std::string& s, int* out) {
  if (s.empty() || s.size() > 6) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  *out = std::stoi(s);
  return true;
}
}  // namespace

Device::Device(const std::string& text) {
  std::string kind = text, idx;
  auto colon = text.find(':');
  if (colon != std::string::npos) {
    kind = text.substr(0, colon);
    idx = text.substr(colon + 1);
  }
  if (kind == "cpu") {
    type = DeviceType::CPU;
  } else if (kind == "cuda" || kind == "gpu") {
    type = DeviceType::CUDA;
  } else {
    CHORUS_THROW(ValueError, "unknown device '", text, "' (expected cpu, cpu:N, cuda or cuda:N)");
  }
  index = 0;
  if (colon != std::string::npos && !parse_index(idx, &index)) {
    CHORUS_THROW(ValueError, "bad device index in '", text, "' (expected cpu:N or cuda:N, N >= 0)");
  }
}

std::string Device::str() const {
  return std::string(type == DeviceType::CPU ? "cpu" : "cuda") + ":" + std::to_string(index);
}

std::ostream& operator<<(std::ostream& os, const Device& d) { return os << d.str(); }

namespace detail {

int parse_cpu_device_count(const char* env) {
  if (env == nullptr) return kDefaultCpuDevices;
  int v = 0;
  // An invalid value is an error, never the default in disguise.
  CHORUS_CHECK(parse_index(env, &v) && v >= 1 && v <= kMaxCpuDevices, "CHORUS_CPU_DEVICES='", env,
               "' is not a whole number from 1 to ", kMaxCpuDevices, " (unset it for the default, ",
               kDefaultCpuDevices, ")");
  return v;
}

}  // namespace detail

int cpu_device_count() {
  static int n = detail::parse_cpu_device_count(chorus::env::get("CHORUS_CPU_DEVICES"));
  return n;
}

int cuda_device_count() {
  if (!has_backend(DeviceType::CUDA)) return 0;
  return backend(DeviceType::CUDA).device_count();
}

bool cuda_is_available() { return cuda_device_count() > 0; }

void check_device(const Device& d) {
  if (d.is_cpu()) {
    CHORUS_CHECK(d.index >= 0 && d.index < cpu_device_count(), "device ", d.str(),
                 " does not exist: there are ", cpu_device_count(),
                 " logical CPU devices (cpu:0..cpu:", cpu_device_count() - 1,
                 "; set CHORUS_CPU_DEVICES for more)");
    return;
  }
  int n = cuda_device_count();
  if (n == 0) {
    CHORUS_THROW(DeviceError, "device ", d.str(), " was requested but no CUDA GPU is available",
                 has_backend(DeviceType::CUDA) ? "" : " (this build has no CUDA support)");
  }
  CHORUS_CHECK_T(DeviceError, d.index >= 0 && d.index < n, "device ", d.str(),
                 " does not exist: this machine has ", n, " CUDA device", n == 1 ? "" : "s",
                 " (cuda:0..cuda:", n - 1, ")");
}

std::vector<Device> parse_devices(const std::string& text) {
  std::vector<Device> out;
  if (text == "all") {
    int n = cuda_device_count();
    if (n == 0) return {cpu_device(0)};
    for (int i = 0; i < n; ++i) out.push_back(cuda_device(i));
    return out;
  }
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    std::string item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    CHORUS_CHECK(!item.empty(), "empty device name in device list '", text, "'");
    Device d(item);
    check_device(d);
    for (const Device& e : out)
      CHORUS_CHECK(e != d, "device ", d.str(), " appears twice in device list '", text, "'");
    out.push_back(d);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  CHORUS_CHECK(!out.empty(), "empty device list");
  return out;
}

Device current_device() { return t_current_device; }

void set_device(const Device& d) {
  check_device(d);
  t_current_device = d;
}

DeviceGuard::DeviceGuard(const Device& d) : prev_(t_current_device) { set_device(d); }
DeviceGuard::~DeviceGuard() { t_current_device = prev_; }

}  // namespace chorus
