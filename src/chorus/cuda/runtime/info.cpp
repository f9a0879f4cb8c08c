#include "chorus/cuda/runtime/info.h"

#include <cuda_runtime.h>
#ifdef CHORUS_WITH_CUDNN
#include <cudnn.h>
#endif
#ifdef CHORUS_WITH_NCCL
#include <nccl.h>
#endif
#ifdef CHORUS_WITH_CUPTI
#include <cupti.h>
#endif

#include <cstdio>

#include "chorus/core/device.h"

namespace chorus::cuda {

std::string build_info() {
  char buf[256];
  int rt = 0, drv = 0;
  cudaRuntimeGetVersion(&rt);
  if (cudaDriverGetVersion(&drv) != cudaSuccess) drv = 0;
  std::snprintf(buf, sizeof buf, "CUDA: %d.%d (driver %s)\n", rt / 1000, (rt % 1000) / 10,
                drv ? (std::to_string(drv / 1000) + "." + std::to_string((drv % 1000) / 10)).c_str() : "none");
  std::string s = buf;
#ifdef CHORUS_WITH_CUDNN
  size_t v = cudnnGetVersion();
  std::snprintf(buf, sizeof buf, "cuDNN: %zu.%zu.%zu\n", v / 10000, (v % 10000) / 100, v % 100);
  s += buf;
#else
  s += "cuDNN: no\n";
#endif
#ifdef CHORUS_WITH_NCCL
  int nv = 0;
  ncclGetVersion(&nv);
  std::snprintf(buf, sizeof buf, "NCCL: %d.%d.%d\n", nv / 10000, (nv % 10000) / 100, nv % 100);
  s += buf;
#else
  s += "NCCL: no\n";
#endif
#ifdef CHORUS_WITH_CUPTI
  uint32_t cv = 0;
  cuptiGetVersion(&cv);
  std::snprintf(buf, sizeof buf, "CUPTI: API %u (--trace records the GPUs' kernels, collectives and copies)\n", cv);
  s += buf;
#else
  s += "CUPTI: no (--trace shows the host's spans and kernel launches only)\n";
#endif
  return s;
}

std::string devices_report() {
  std::string s;
  char buf[512];
  int n = cuda_device_count();
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp p{};
    cudaGetDeviceProperties(&p, i);
    size_t free_b = 0, total_b = 0;
    cudaSetDevice(i);
    cudaMemGetInfo(&free_b, &total_b);
    std::snprintf(buf, sizeof buf, "cuda:%d  %s  %.1f GiB (%.1f GiB free)  compute %d.%d  %d SMs\n", i, p.name,
                  total_b / 1073741824.0, free_b / 1073741824.0, p.major, p.minor, p.multiProcessorCount);
    s += buf;
  }
  if (n > 1) {
    s += "peer access (P = peer-to-peer possible; NVLink performance rank in brackets):\n      ";
    for (int j = 0; j < n; ++j) s += "cuda:" + std::to_string(j) + "  ";
    s += "\n";
    for (int i = 0; i < n; ++i) {
      s += "cuda:" + std::to_string(i) + " ";
      for (int j = 0; j < n; ++j) {
        if (i == j) { s += "   -    "; continue; }
        int can = 0, rank = 0;
        cudaDeviceCanAccessPeer(&can, i, j);
        cudaDeviceGetP2PAttribute(&rank, cudaDevP2PAttrPerformanceRank, i, j);
        std::snprintf(buf, sizeof buf, "  %s[%d]  ", can ? "P" : "-", rank);
        s += buf;
      }
      s += "\n";
    }
  }
  return s;
}

}  // namespace chorus::cuda
