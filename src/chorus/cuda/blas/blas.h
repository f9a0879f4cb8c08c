// cuBLASLt for the CUDA kernel set: one handle per (thread, device), one GEMM
// workspace per (device, stream), the CHORUS_CUBLAS_CHECK macro, and the TF32
// switches that matmuls (here) and convolutions (conv.cpp) consult.
// Include only from src/chorus/cuda.
//
// Note [TF32 defaults]: the defaults are PyTorch's. Convolutions may use TF32
// tensor cores for float32 (torch.backends.cudnn.allow_tf32 = True), matmuls
// may not (torch.backends.cuda.matmul.allow_tf32 = False): a float32 Linear
// layer then gives the same numbers as on the CPU to float32 rounding, while
// the convolutions that dominate a ResNet step run at tensor-core speed.
// bfloat16 and float16 always use tensor cores, accumulating in float32.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>

#include "chorus/core/error.h"

namespace chorus::cuda {

// Throws DeviceError with cuBLAS's status name and description, the call and
// file:line.
void throw_cublas_error(cublasStatus_t status, const char* call, const char* file, int line);

#define CHORUS_CUBLAS_CHECK(call) \
  CHORUS_STATUS_CHECK(cublasStatus_t, CUBLAS_STATUS_SUCCESS, ::chorus::cuda::throw_cublas_error, call, #call)

// TF32 switches (Note [TF32 defaults]); process-wide, read at each call.
void set_allow_tf32_matmul(bool allow);  // default false
bool allow_tf32_matmul();
void set_allow_tf32_conv(bool allow);  // default true
bool allow_tf32_conv();
// Sets both switches (tests turn TF32 off to compare float32 with the CPU).
void set_allow_tf32(bool allow);
// True when both matmuls and convolutions may use TF32.
bool allow_tf32();
// Deterministic convolutions (PyTorch's torch.backends.cudnn.deterministic):
// cuDNN engines and algorithms noted as non-deterministic (atomics in the
// weight gradient) are not chosen, so a step gives the same bits every time.
// Off by default (those are often the fastest); CHORUS_DETERMINISTIC=1 in the
// environment turns it on. Plans are cached per setting.
void set_deterministic(bool on);
bool deterministic();

// This thread's cuBLASLt handle for `device`, created on first use. Handles of
// a thread that exits go back to a pool for the next thread, so threads that
// come and go (DataParallel replicas) do not leak handles.
cublasLtHandle_t cublaslt_handle(int device);

// The GEMM workspace for work on `stream` of `device` (kCublasWorkspaceBytes,
// allocated once from the device's stream-ordered allocator and kept). One per
// stream, because two streams running GEMMs at once must not share scratch.
inline constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;  // Hopper's recommended size
void* cublas_workspace(int device, cudaStream_t stream);

}  // namespace chorus::cuda
