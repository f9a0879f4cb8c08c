// The check macro of each foreign library (CUDA runtime, cuBLASLt, cuDNN,
// NCCL): a failure status becomes the chorus error with the library's own
// message, the call and file:line. Statuses are given, not provoked, so these
// run without a GPU.
#ifdef CHORUS_WITH_CUDA

#include <gtest/gtest.h>

#include <string>

#include "chorus/core/error.h"
#include "chorus/cuda/blas/blas.h"
#include "chorus/cuda/runtime/context.h"
#ifdef CHORUS_WITH_CUDNN
#include "chorus/cuda/cudnn/cudnn_handle.h"
#endif
#ifdef CHORUS_WITH_NCCL
#include "chorus/cuda/runtime/nccl_check.h"
#endif

namespace chorus {
namespace {

// The message of the Kind that running `f` throws ("" when it throws nothing).
template <typename Kind, typename F>
std::string thrown(F&& f) {
  try {
    f();
  } catch (const Kind& e) {
    return e.what();
  }
  return "";
}

void expect_names(const std::string& what, const std::string& library_text, const std::string& call) {
  EXPECT_NE(what.find(library_text), std::string::npos) << what;
  EXPECT_NE(what.find(call), std::string::npos) << what;
  EXPECT_NE(what.find("check_macros_test.cpp:"), std::string::npos) << what;
}

cudaError_t failing_cuda_call() { return cudaErrorInvalidValue; }
cublasStatus_t failing_cublas_call() { return CUBLAS_STATUS_INVALID_VALUE; }

TEST(CheckMacros, CudaFailureIsDeviceErrorWithCudasMessage) {
  const std::string what = thrown<DeviceError>([] { CHORUS_CUDA_CHECK(failing_cuda_call()); });
  expect_names(what, cudaGetErrorString(cudaErrorInvalidValue), "failing_cuda_call()");
  EXPECT_NO_THROW(CHORUS_CUDA_CHECK(cudaSuccess));
}

TEST(CheckMacros, CublasFailureIsDeviceErrorWithCublassName) {
  const std::string what = thrown<DeviceError>([] { CHORUS_CUBLAS_CHECK(failing_cublas_call()); });
  expect_names(what, "CUBLAS_STATUS_INVALID_VALUE", "failing_cublas_call()");
  EXPECT_NO_THROW(CHORUS_CUBLAS_CHECK(CUBLAS_STATUS_SUCCESS));
}

#ifdef CHORUS_WITH_CUDNN
cudnnStatus_t failing_cudnn_call() { return CUDNN_STATUS_BAD_PARAM; }

TEST(CheckMacros, CudnnFailureIsDeviceErrorWithCudnnsMessage) {
  const std::string what = thrown<DeviceError>([] { CHORUS_CUDNN_CHECK(failing_cudnn_call()); });
  expect_names(what, cudnnGetErrorString(CUDNN_STATUS_BAD_PARAM), "failing_cudnn_call()");
  EXPECT_NO_THROW(CHORUS_CUDNN_CHECK(CUDNN_STATUS_SUCCESS));
}
#endif

#ifdef CHORUS_WITH_NCCL
ncclResult_t failing_nccl_call() { return ncclInvalidArgument; }

TEST(CheckMacros, NcclFailureIsDeviceErrorOrTheKindAskedFor) {
  const std::string what = thrown<DeviceError>([] { CHORUS_NCCL_CHECK(failing_nccl_call()); });
  expect_names(what, std::string("NCCL error: ") + ncclGetErrorString(ncclInvalidArgument), "failing_nccl_call()");
  // distributed/'s process groups report their failures as DistError.
  const std::string dist = thrown<DistError>([] { CHORUS_NCCL_CHECK_T(DistError, failing_nccl_call()); });
  expect_names(dist, ncclGetErrorString(ncclInvalidArgument), "failing_nccl_call()");
  EXPECT_NO_THROW(CHORUS_NCCL_CHECK(ncclSuccess));
  EXPECT_EQ(cuda::nccl_error_message(ncclInvalidArgument, "ncclAllReduce", nullptr, "cuda:0, cuda:1"),
            std::string("NCCL error: ") + ncclGetErrorString(ncclInvalidArgument) +
                " in ncclAllReduce over cuda:0, cuda:1");
}
#endif

}  // namespace
}  // namespace chorus

#endif  // CHORUS_WITH_CUDA
