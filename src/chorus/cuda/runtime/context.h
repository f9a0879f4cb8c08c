// CUDA context: per-device state (streams) and the CUDA runtime's check macros
// (CHORUS_CUDA_CHECK, CHORUS_CUDA_LAUNCH_CHECK). Each other library's macro
// sits beside its wrapper: CHORUS_CUBLAS_CHECK in blas.h, CHORUS_CUDNN_CHECK
// in cudnn_handle.h, CHORUS_NCCL_CHECK and CHORUS_NCCL_CHECK_T in
// nccl_check.h; all are CHORUS_STATUS_CHECK (core/error.h) with the library's
// status type and thrower. Include only from src/chorus/cuda (and distributed/'s NCCL
// process group).
//
// Note [Current stream]: each (thread, device) pair has a current stream,
// initially the device's one process-wide default stream created by Chorus (not the
// legacy NULL stream, which would serialise with everything). Every kernel of
// the kernel set is launched on current_stream(device).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "chorus/core/device.h"
#include "chorus/core/error.h"

namespace chorus::cuda {

// Throws DeviceError with CUDA's own message, the call and file:line.
void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line);

#define CHORUS_CUDA_CHECK(call) \
  CHORUS_STATUS_CHECK(cudaError_t, cudaSuccess, ::chorus::cuda::throw_cuda_error, call, #call)

// After every kernel launch: catches bad launch configurations at once.
#define CHORUS_CUDA_LAUNCH_CHECK() CHORUS_CUDA_CHECK(cudaGetLastError())

// Makes `index` the CUDA runtime's current device for this thread (cheap when
// it already is).
void set_cuda_device(int index);

// RAII: switches the runtime's current device and restores it.
class CudaDeviceGuard {
 public:
  explicit CudaDeviceGuard(int index);
  ~CudaDeviceGuard();
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;

 private:
  int prev_;
};

// The current stream of `index` for this thread (Note [Current stream]).
cudaStream_t current_stream(int index);
void set_current_stream(int index, cudaStream_t s);

// Whether `s` is being captured into a CUDA graph (Note [CUDA graphs]); makes
// no CUDA call unless a capture is in progress somewhere in the process.
bool is_capturing(cudaStream_t s);
// Whether work on `waiter` may wait for work on `other`: neither is being
// captured, or both are, into the same graph. A capturing stream may not wait
// for work outside its capture (cudaErrorStreamCaptureIsolation), nor an
// eager stream for a capturing one. Used by the communication joins, whose
// side streams may have had no work in the capture being recorded.
bool same_capture(cudaStream_t waiter, cudaStream_t other);

// Device properties, cached.
const cudaDeviceProp& device_properties(int index);

// Whether peer access from `from` to `to` was enabled (tried once, at first use
// of a pair, when allowed).
bool peer_access_enabled(int from, int to);
// A stream-ordered pool of `device` besides its default one (Note [Persistent
// allocations] in core/persistent_alloc.h): the peers granted access to the
// default pool get it to this one too, those granted already and later ones.
void register_device_pool(int device, cudaMemPool_t pool);

// Note [Peer access policy]: peer-to-peer access between GPUs is allowed by
// default. CHORUS_PEER_ACCESS=0 in the environment, or
// set_peer_access_allowed(false), turns it off (and revokes what was enabled):
// cross-GPU copies then go through the host, as on machines whose GPUs cannot
// reach each other. Tests use it to check both paths; users can use it to rule
// out a broken P2P setup.
void set_peer_access_allowed(bool allowed);
bool peer_access_allowed();

}  // namespace chorus::cuda
