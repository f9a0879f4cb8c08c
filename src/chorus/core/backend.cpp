#include "chorus/core/backend.h"

#include <array>
#include <mutex>

#include "chorus/core/error.h"

#ifdef CHORUS_WITH_CUDA
namespace chorus::cuda {
// Defined in src/chorus/cuda/runtime/backend.cpp. Called here (rather than from a static
// initialiser there) because a static library drops object files that nothing
// references, and with them their initialisers.
void register_cuda_backend();
}  // namespace chorus::cuda
#endif

namespace chorus {

namespace {
std::array<std::unique_ptr<DeviceBackend>, 2>& registry() {
  // Leaked on purpose: a tensor freed during static destruction (a global, a
  // late thread) must still find its backend.
  static auto* r = new std::array<std::unique_ptr<DeviceBackend>, 2>();
  return *r;
}
#ifdef CHORUS_WITH_CUDA
std::once_flag& cuda_once() {
  static std::once_flag f;
  return f;
}
#endif
void ensure_registered(DeviceType t) {
  if (t == DeviceType::CUDA) {
#ifdef CHORUS_WITH_CUDA
    std::call_once(cuda_once(), [] { cuda::register_cuda_backend(); });
#endif
  }
}
}  // namespace

std::unique_ptr<DeviceBackend> make_cpu_backend();  // cpu_backend.cpp

void register_backend(std::unique_ptr<DeviceBackend> b) {
  registry()[static_cast<int>(b->type())] = std::move(b);
}

bool has_backend(DeviceType t) {
  ensure_registered(t);
  return registry()[static_cast<int>(t)] != nullptr;
}

DeviceBackend& backend(DeviceType t) {
  if (t == DeviceType::CPU) {
    static DeviceBackend* cpu = [] {
      register_backend(make_cpu_backend());
      return registry()[0].get();
    }();
    return *cpu;
  }
  ensure_registered(t);
  auto& b = registry()[static_cast<int>(t)];
  if (!b) {
    CHORUS_THROW(DeviceError,
                 "this build of Chorus has no CUDA support (built without the CUDA toolkit); "
                 "use a cpu device");
  }
  return *b;
}

void synchronize() {
  int n = cuda_device_count();
  for (int i = 0; i < n; ++i) backend(DeviceType::CUDA).synchronize(cuda_device(i));
}

void synchronize(const Device& d) {
  check_device(d);
  backend(d).synchronize(d);
}

}  // namespace chorus

namespace chorus {

void DeviceBackend::capture_begin(Device d, StreamHandle) {
  CHORUS_THROW(CaptureError, "CUDA graphs need a CUDA device; ", d.str(), " runs eagerly");
}
DeviceBackend::GraphHandle DeviceBackend::capture_end(Device d, StreamHandle) {
  CHORUS_THROW(CaptureError, "CUDA graphs need a CUDA device; ", d.str(), " runs eagerly");
}
void DeviceBackend::capture_fork(Device d, StreamHandle, Device, StreamHandle) {
  CHORUS_THROW(CaptureError, "CUDA graphs need a CUDA device; ", d.str(), " runs eagerly");
}
void DeviceBackend::capture_join(Device d, StreamHandle, Device, StreamHandle) {
  CHORUS_THROW(CaptureError, "CUDA graphs need a CUDA device; ", d.str(), " runs eagerly");
}
void DeviceBackend::graph_replay(Device d, GraphHandle, StreamHandle) {
  CHORUS_THROW(CaptureError, "CUDA graphs need a CUDA device; ", d.str(), " runs eagerly");
}

}  // namespace chorus
