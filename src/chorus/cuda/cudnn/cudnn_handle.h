// cuDNN for the CUDA kernel set: one handle per (thread, device) bound to the
// current stream, the CHORUS_CUDNN_CHECK macro, and the RAII legacy-API
// descriptors (tensors, filters, convolutions) of conv.cpp and batch_norm.cpp.
// Include only from src/chorus/cuda, in builds with CHORUS_WITH_CUDNN.
//
// Chorus uses cuDNN 9's legacy (descriptor) API, deprecated but complete: it
// covers what the kernel set needs (convolutions with algorithm search, batch
// norm) in a few calls. CHORUS_CUDNN_LEGACY_BEGIN/END silence the deprecation
// warnings around code that uses it.
#pragma once

#include "chorus/cuda/runtime/caches.h"

#include <cudnn.h>

#include "chorus/core/dtype.h"
#include "chorus/core/error.h"
#include "chorus/core/tensor.h"

#define CHORUS_CUDNN_LEGACY_BEGIN \
  _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wdeprecated-declarations\"")
#define CHORUS_CUDNN_LEGACY_END _Pragma("GCC diagnostic pop")

namespace chorus::cuda {

// Throws DeviceError with cudnnGetErrorString's message, the call and file:line.
void throw_cudnn_error(cudnnStatus_t status, const char* call, const char* file, int line);

#define CHORUS_CUDNN_CHECK(call) \
  CHORUS_STATUS_CHECK(cudnnStatus_t, CUDNN_STATUS_SUCCESS, ::chorus::cuda::throw_cudnn_error, call, #call)

// This thread's cuDNN handle for `device`, set to current_stream(device). cuDNN
// runs on the runtime's current device, so the caller holds a CudaDeviceGuard
// for `device` while using it. Handles of exiting threads go back to a pool,
// as cuBLASLt's do (blas.h).
cudnnHandle_t cudnn_handle(int device);

// cuDNN's name for a floating dtype; throws ValueError naming `op` otherwise.
cudnnDataType_t cudnn_dtype(DType t, const char* op);

// Memory layout of a 4-d [N,C,H,W] tensor.
enum class Layout { NCHW, NHWC };

// Whether `t` (4-d) is dense in `layout`: its strides are the packed strides of
// that layout, ignoring dims of size 1 (whose strides never matter).
bool is_dense_in(const Tensor& t, Layout layout);
// The layout a 4-d activation is stored in: the one it is dense in when only
// one fits, `fallback` when both fit (e.g. C == 1 or H == W == 1), and throws
// ValueError naming `op` and `arg` when neither does.
Layout layout_of(const Tensor& t, Layout fallback, const char* op, const char* arg);

// An uninitialised 4-d tensor with [N,C,H,W] `sizes` stored in `layout`.
Tensor empty_in(Layout layout, const Shape& sizes, DType dtype, Device device);

// A cuDNN (legacy API) descriptor, created at construction and destroyed with
// its owner (Owned: cuda/runtime/caches.h).
template <typename T, cudnnStatus_t (*Create)(T*), auto Destroy>
class CudnnDescriptor {
 public:
  CudnnDescriptor() { CHORUS_CUDNN_CHECK(Create(d_.out())); }
  T get() const { return d_.get(); }

 private:
  Owned<T, Destroy> d_;
};

// A cudnnTensorDescriptor_t, unset or for a packed 4-d tensor.
class TensorDesc
    : public CudnnDescriptor<cudnnTensorDescriptor_t, cudnnCreateTensorDescriptor, cudnnDestroyTensorDescriptor> {
 public:
  TensorDesc() = default;
  // sizes are [N,C,H,W] whatever the layout.
  TensorDesc(cudnnDataType_t dtype, Layout layout, int64_t n, int64_t c, int64_t h, int64_t w);
};

}  // namespace chorus::cuda
