// cuBLASLt handles, workspaces, errors and the TF32 switches (see blas.h).
#include "chorus/core/env_switches.h"
#include "chorus/cuda/blas/blas.h"
#include "chorus/cuda/blas/cublaslt_api.h"

#include <atomic>
#include <cstdlib>
#include <map>
#include <string>
#include <mutex>
#include <utility>
#include <vector>

#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/cuda/runtime/caches.h"
#include "chorus/cuda/runtime/context.h"

namespace chorus::cuda {

void throw_cublas_error(cublasStatus_t status, const char* call, const char* file, int line) {
  throw DeviceError(detail::str_cat("cuBLAS error ", lt::GetStatusName(status), " (",
                                    lt::GetStatusString(status), ") in ", call),
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

namespace {
std::atomic<bool>& deterministic_flag() {
  static std::atomic<bool> flag{[] {
    const char* e = chorus::env::get("CHORUS_DETERMINISTIC");
    return e && *e && std::string(e) != "0";
  }()};
  return flag;
}
}  // namespace
void set_deterministic(bool on) { deterministic_flag().store(on); }
bool deterministic() { return deterministic_flag().load(); }

// ---- handles ------------------------------------------------------------------------

cublasLtHandle_t cublaslt_handle(int device) {
  return ThreadHandles<cublasLtHandle_t>::get(device, [](int d) {
    CudaDeviceGuard guard(d);
    cublasLtHandle_t h = nullptr;
    CHORUS_CUBLAS_CHECK(lt::Create(&h));
    return h;
  });
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
    // Straight from the driver, not the allocator: a stream first used inside
    // a CUDA graph capture would otherwise take it from the graph's private
    // pool (Note [Graph pools]) and keep that pool alive for good. cudaMalloc
    // is not captured; Relaxed lets it run whatever mode a capture is in.
    CudaDeviceGuard guard(device);
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    CHORUS_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    const cudaError_t err = cudaMalloc(&p, kCublasWorkspaceBytes);
    (void)cudaThreadExchangeStreamCaptureMode(&mode);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      p = nullptr;
      CHORUS_THROW(OutOfMemoryError, "out of memory on cuda:", device, ": the ", kCublasWorkspaceBytes >> 20,
                   " MiB cuBLAS workspace could not be allocated (", cudaGetErrorString(err), ")");
    }
  }
  return p;
}

}  // namespace chorus::cuda
