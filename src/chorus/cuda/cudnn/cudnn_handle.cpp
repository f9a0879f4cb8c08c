// cuDNN handles, errors, layouts and tensor descriptors (see cudnn_handle.h).
#include "chorus/cuda/cudnn/cudnn_handle.h"

#include <climits>
#include <mutex>
#include <vector>

#include "chorus/core/error.h"
#include "chorus/core/graph_capture.h"
#include "chorus/cuda/runtime/caches.h"
#include "chorus/cuda/runtime/context.h"

namespace chorus::cuda {

void throw_cudnn_error(cudnnStatus_t status, const char* call, const char* file, int line) {
  note_capture_error(detail::str_cat(cudnnGetErrorString(status), " in ", call, " (", file, ":", line, ")"));
  throw DeviceError(detail::str_cat("cuDNN error: ", cudnnGetErrorString(status), " in ", call),
                    file, line);
}

// ---- handles ------------------------------------------------------------------------

cudnnHandle_t cudnn_handle(int device) {
  cudnnHandle_t h = ThreadHandles<cudnnHandle_t>::get(device, [](int d) {
    CudaDeviceGuard guard(d);  // cudnnCreate binds the handle to the current device
    cudnnHandle_t made = nullptr;
    CHORUS_CUDNN_CHECK(cudnnCreate(&made));
    return made;
  });
  // Cheap, and keeps the handle on whatever stream is current now (streams
  // change under a StreamGuard or a DataParallel replica's thread).
  CHORUS_CUDNN_CHECK(cudnnSetStream(h, current_stream(device)));
  return h;
}

cudnnDataType_t cudnn_dtype(DType t, const char* op) {
  switch (t) {
    case kFloat32:
      return CUDNN_DATA_FLOAT;
    case kBFloat16:
      return CUDNN_DATA_BFLOAT16;
    case kFloat16:
      return CUDNN_DATA_HALF;
    default:
      CHORUS_THROW(ValueError, op, " on CUDA supports float32, bfloat16 and float16, got ",
                   dtype_name(t));
  }
}

// ---- layouts --------------------------------------------------------------------------

bool is_dense_in(const Tensor& t, Layout layout) {
  if (t.dim() != 4) return false;
  // Dims from the fastest-varying to the slowest, in this layout.
  const int order_nchw[4] = {3, 2, 1, 0};
  const int order_nhwc[4] = {1, 3, 2, 0};
  const int* order = layout == Layout::NCHW ? order_nchw : order_nhwc;
  int64_t expected = 1;
  for (int i = 0; i < 4; ++i) {
    const int d = order[i];
    if (t.size(d) != 1 && t.stride(d) != expected) return false;
    expected *= t.size(d);
  }
  return true;
}

Layout layout_of(const Tensor& t, Layout fallback, const char* op, const char* arg) {
  const bool nchw = is_dense_in(t, Layout::NCHW), nhwc = is_dense_in(t, Layout::NHWC);
  CHORUS_CHECK(nchw || nhwc, op, ": argument '", arg,
               "' must be a 4-d tensor, contiguous (NCHW) or channels-last (NHWC), got ",
               t.describe(), " with strides ", shape_str(t.strides()));
  if (nchw && nhwc) return fallback;
  return nchw ? Layout::NCHW : Layout::NHWC;
}

Tensor empty_in(Layout layout, const Shape& sizes, DType dtype, Device device) {
  if (layout == Layout::NCHW) return detail::empty_tensor(sizes, dtype, device);
  const int64_t n = sizes[0], c = sizes[1], h = sizes[2], w = sizes[3];
  Tensor t = detail::empty_tensor({n, h, w, c}, dtype, device);
  return detail::make_view(t, sizes, {h * w * c, 1, w * c, c}, 0);
}

// ---- descriptors ----------------------------------------------------------------------

TensorDesc::TensorDesc(cudnnDataType_t dtype, Layout layout, int64_t n, int64_t c, int64_t h,
                       int64_t w) {
  CHORUS_CHECK(
      n <= INT_MAX && c <= INT_MAX && h <= INT_MAX && w <= INT_MAX && n * c * h * w <= INT_MAX,
      "cuDNN: tensor [", n, ", ", c, ", ", h, ", ", w,
      "] exceeds cuDNN's 2^31 element limit; split the batch");
  CHORUS_CUDNN_CHECK(cudnnSetTensor4dDescriptor(
      get(), layout == Layout::NCHW ? CUDNN_TENSOR_NCHW : CUDNN_TENSOR_NHWC, dtype,
      static_cast<int>(n), static_cast<int>(c), static_cast<int>(h), static_cast<int>(w)));
}


}  // namespace chorus::cuda
