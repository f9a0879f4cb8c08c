// Note [cuBLASLt loaded lazily]
// libcublasLt's static initialisers take about 0.4 s of CPU time (perf: page
// faults under its init functions) in every process that links it, whether
// or not it ever multiplies a matrix: each `chorus` command, each rank of a
// distributed job, each unit-test process (CI runs ~550 of them on a machine
// with no GPU). So the library is not linked; it is opened with dlopen at
// the first cuBLASLt call, by soname (found through the binary's run path,
// as the linked CUDA libraries are) and else from the toolkit directory the
// build found, and each function is looked up once.
#include "chorus/cuda/blas/cublaslt_api.h"

#include <dlfcn.h>

#include <mutex>
#include <string>

#include "chorus/core/error.h"

#ifndef CHORUS_CUBLASLT_DIR
#define CHORUS_CUBLASLT_DIR ""
#endif

namespace chorus::cuda::lt {
namespace {

#define CHORUS_STR2(x) #x
#define CHORUS_STR(x) CHORUS_STR2(x)

struct Api {
  decltype(&cublasLtCreate) Create = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) MatrixLayoutCreate = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) MatrixLayoutDestroy = nullptr;
  decltype(&cublasLtMatrixLayoutSetAttribute) MatrixLayoutSetAttribute = nullptr;
  decltype(&cublasLtMatmulDescCreate) MatmulDescCreate = nullptr;
  decltype(&cublasLtMatmulDescDestroy) MatmulDescDestroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) MatmulDescSetAttribute = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) MatmulPreferenceCreate = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) MatmulPreferenceDestroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) MatmulPreferenceSetAttribute = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) MatmulAlgoGetHeuristic = nullptr;
  decltype(&cublasLtMatmul) Matmul = nullptr;
  decltype(&cublasLtGetStatusName) GetStatusName = nullptr;
  decltype(&cublasLtGetStatusString) GetStatusString = nullptr;
  std::string error;  // why it did not load
};

Api load() {
  Api api;
  const std::string soname = "libcublasLt.so." CHORUS_STR(CUBLAS_VER_MAJOR);
  void* lib = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
  std::string why = lib ? "" : dlerror();
  if (!lib && *CHORUS_CUBLASLT_DIR) {
    const std::string path = std::string(CHORUS_CUBLASLT_DIR) + "/" + soname;
    lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!lib) why += std::string("; ") + dlerror();
  }
  if (!lib) {
    api.error = "cannot load cuBLASLt (" + soname + "): " + why;
    return api;
  }
  bool ok = true;
  auto find = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
    if (!fn && ok) {
      api.error = "cuBLASLt (" + soname + ") has no " + name;
      ok = false;
    }
  };
  find(api.Create, "cublasLtCreate");
  find(api.MatrixLayoutCreate, "cublasLtMatrixLayoutCreate");
  find(api.MatrixLayoutDestroy, "cublasLtMatrixLayoutDestroy");
  find(api.MatrixLayoutSetAttribute, "cublasLtMatrixLayoutSetAttribute");
  find(api.MatmulDescCreate, "cublasLtMatmulDescCreate");
  find(api.MatmulDescDestroy, "cublasLtMatmulDescDestroy");
  find(api.MatmulDescSetAttribute, "cublasLtMatmulDescSetAttribute");
  find(api.MatmulPreferenceCreate, "cublasLtMatmulPreferenceCreate");
  find(api.MatmulPreferenceDestroy, "cublasLtMatmulPreferenceDestroy");
  find(api.MatmulPreferenceSetAttribute, "cublasLtMatmulPreferenceSetAttribute");
  find(api.MatmulAlgoGetHeuristic, "cublasLtMatmulAlgoGetHeuristic");
  find(api.Matmul, "cublasLtMatmul");
  find(api.GetStatusName, "cublasLtGetStatusName");
  find(api.GetStatusString, "cublasLtGetStatusString");
  return api;
}

// Loaded once, never unloaded (handles live until the process exits).
const Api& api() {
  static const Api* a = new Api(load());
  return *a;
}

const Api& loaded() {
  const Api& a = api();
  if (!a.error.empty()) CHORUS_THROW(DeviceError, a.error);
  return a;
}

}  // namespace

cublasStatus_t Create(cublasLtHandle_t* handle) { return loaded().Create(handle); }
cublasStatus_t MatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type, uint64_t rows,
                                  uint64_t cols, int64_t ld) {
  return loaded().MatrixLayoutCreate(layout, type, rows, cols, ld);
}
cublasStatus_t MatrixLayoutDestroy(cublasLtMatrixLayout_t layout) { return loaded().MatrixLayoutDestroy(layout); }
cublasStatus_t MatrixLayoutSetAttribute(cublasLtMatrixLayout_t layout, cublasLtMatrixLayoutAttribute_t attr,
                                        const void* buf, size_t size) {
  return loaded().MatrixLayoutSetAttribute(layout, attr, buf, size);
}
cublasStatus_t MatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute, cudaDataType_t scale) {
  return loaded().MatmulDescCreate(desc, compute, scale);
}
cublasStatus_t MatmulDescDestroy(cublasLtMatmulDesc_t desc) { return loaded().MatmulDescDestroy(desc); }
cublasStatus_t MatmulDescSetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                                      const void* buf, size_t size) {
  return loaded().MatmulDescSetAttribute(desc, attr, buf, size);
}
cublasStatus_t MatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) { return loaded().MatmulPreferenceCreate(pref); }
cublasStatus_t MatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  return loaded().MatmulPreferenceDestroy(pref);
}
cublasStatus_t MatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                            cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                                            size_t size) {
  return loaded().MatmulPreferenceSetAttribute(pref, attr, buf, size);
}
cublasStatus_t MatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                      cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                      cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                      cublasLtMatmulPreference_t pref, int requested,
                                      cublasLtMatmulHeuristicResult_t results[], int* returned) {
  return loaded().MatmulAlgoGetHeuristic(handle, desc, a, b, c, d, pref, requested, results, returned);
}
cublasStatus_t Matmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha, const void* a,
                      cublasLtMatrixLayout_t adesc, const void* b, cublasLtMatrixLayout_t bdesc,
                      const void* beta, const void* c, cublasLtMatrixLayout_t cdesc, void* d,
                      cublasLtMatrixLayout_t ddesc, const cublasLtMatmulAlgo_t* algo, void* workspace,
                      size_t workspace_bytes, cudaStream_t stream) {
  return loaded().Matmul(handle, desc, alpha, a, adesc, b, bdesc, beta, c, cdesc, d, ddesc, algo, workspace,
                         workspace_bytes, stream);
}
const char* GetStatusName(cublasStatus_t status) {
  const Api& a = api();
  return a.GetStatusName ? a.GetStatusName(status) : "?";
}
const char* GetStatusString(cublasStatus_t status) {
  const Api& a = api();
  return a.GetStatusString ? a.GetStatusString(status) : "?";
}

}  // namespace chorus::cuda::lt
