// cuBLASLt handles, workspaces, errors and the TF32 switches (see blas.h).
#include "chorus/cuda/blas.h"

#include <atomic>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/cuda/context.h"

namespace chorus::cuda {

void throw_cublas_error(cublasStatus_t status, const char* call, const char* file, int line) {
  throw DeviceError(detail::str_cat("cuBLAS error ", cublasLtGetStatusName(status), " (",
                                    cublasLtGetStatusString(status), ") in ", call),
                    file, line);
}

// ---- TF32 switches (Note [TF32 defaults]) ---------------------------------------

namespace {
std::atomic<bool> g_tf32_matmul{false};
std::atomic<bool> g_tf32_conv{true};
}  // namespace

void set_allow_tf32_matmul(bool allow) { g_tf32_matmul.store(allow); }
bool allow_tf32_matmul() { return g_tf32_matmul.load(); }
void set_allow_tf32_conv(bool allow) { g_tf32_conv.store(allow); }
bool allow_tf32_conv() { return g_tf32_conv.load(); }
void set_allow_tf32(bool allow) {
  set_allow_tf32_matmul(allow);
  set_allow_tf32_conv(allow);
}
bool allow_tf32() { return allow_tf32_matmul() && allow_tf32_conv(); }

// ---- handles ------------------------------------------------------------------------

namespace {

// Handles not held by any thread, per device. Deliberately leaked: threads
// return their handles here at exit, which may happen during static
// destruction, after the CUDA runtime is gone, so nothing here ever calls into
// CUDA at exit.
struct HandlePool {
  std::mutex mu;
  std::vector<std::vector<cublasLtHandle_t>> free_by_device;
};
HandlePool& handle_pool() {
  static HandlePool* pool = new HandlePool;
  return *pool;
}

struct ThreadHandles {
  std::vector<cublasLtHandle_t> by_device;
  ~ThreadHandles() {
    HandlePool& pool = handle_pool();
    std::lock_guard<std::mutex> lock(pool.mu);
    for (size_t d = 0; d < by_device.size(); ++d) {
      if (!by_device[d]) continue;
      if (pool.free_by_device.size() <= d) pool.free_by_device.resize(d + 1);
      pool.free_by_device[d].push_back(by_device[d]);
    }
  }
};
thread_local ThreadHandles t_handles;

}  // namespace

cublasLtHandle_t cublaslt_handle(int device) {
  auto& mine = t_handles.by_device;
  if (mine.size() <= static_cast<size_t>(device)) mine.resize(device + 1, nullptr);
  if (mine[device]) return mine[device];
  {
    HandlePool& pool = handle_pool();
    std::lock_guard<std::mutex> lock(pool.mu);
    if (pool.free_by_device.size() > static_cast<size_t>(device) &&
        !pool.free_by_device[device].empty()) {
      mine[device] = pool.free_by_device[device].back();
      pool.free_by_device[device].pop_back();
      return mine[device];
    }
  }
  CudaDeviceGuard guard(device);
  cublasLtHandle_t h = nullptr;
  CHORUS_CUBLAS_CHECK(cublasLtCreate(&h));
  mine[device] = h;
  return h;
}

// ---- workspaces ---------------------------------------------------------------------

void* cublas_workspace(int device, cudaStream_t stream) {
  // Kept for the life of the process (a stream handle is rarely destroyed and
  // the buffer is small next to a training run's activations).
  static std::mutex mu;
  static auto* buffers = new std::map<std::pair<int, cudaStream_t>, void*>;
  std::lock_guard<std::mutex> lock(mu);
  void*& p = (*buffers)[{device, stream}];
  if (!p) {
    // allocate() is ordered on the current stream of `device`, which is the
    // stream the caller is about to use (or the memory is idle anyway).
    p = backend(DeviceType::CUDA).allocate(kCublasWorkspaceBytes, Device(DeviceType::CUDA, device));
  }
  return p;
}

}  // namespace chorus::cuda
