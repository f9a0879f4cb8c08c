// cuBLASLt's functions, called through libcublasLt loaded at first use
// (Note [cuBLASLt loaded lazily]). Include only from src/chorus/cuda.
#pragma once

#include <cublasLt.h>

namespace chorus::cuda::lt {

// Throws DeviceError naming the library when it cannot be loaded.
cublasStatus_t Create(cublasLtHandle_t* handle);
cublasStatus_t MatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type, uint64_t rows,
                                  uint64_t cols, int64_t ld);
cublasStatus_t MatrixLayoutDestroy(cublasLtMatrixLayout_t layout);
cublasStatus_t MatrixLayoutSetAttribute(cublasLtMatrixLayout_t layout, cublasLtMatrixLayoutAttribute_t attr,
                                        const void* buf, size_t size);
cublasStatus_t MatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute, cudaDataType_t scale);
cublasStatus_t MatmulDescDestroy(cublasLtMatmulDesc_t desc);
cublasStatus_t MatmulDescSetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                                      const void* buf, size_t size);
cublasStatus_t MatmulPreferenceCreate(cublasLtMatmulPreference_t* pref);
cublasStatus_t MatmulPreferenceDestroy(cublasLtMatmulPreference_t pref);
cublasStatus_t MatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                            cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                                            size_t size);
cublasStatus_t MatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                      cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                      cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                      cublasLtMatmulPreference_t pref, int requested,
                                      cublasLtMatmulHeuristicResult_t results[], int* returned);
cublasStatus_t Matmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha, const void* a,
                      cublasLtMatrixLayout_t adesc, const void* b, cublasLtMatrixLayout_t bdesc,
                      const void* beta, const void* c, cublasLtMatrixLayout_t cdesc, void* d,
                      cublasLtMatrixLayout_t ddesc, const cublasLtMatmulAlgo_t* algo, void* workspace,
                      size_t workspace_bytes, cudaStream_t stream);
// Never throw (they name a status in an error message); "?" when the library
// did not load.
const char* GetStatusName(cublasStatus_t status);
const char* GetStatusString(cublasStatus_t status);

}  // namespace chorus::cuda::lt
