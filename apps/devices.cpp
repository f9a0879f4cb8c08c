// `chorus devices` and `chorus --version`.
#include "commands.h"

#include <cstdio>

#include "chorus/core/backend.h"
#include "chorus/core/device.h"
#ifdef CHORUS_WITH_CUDA
#include "chorus/cuda/info.h"
#endif

namespace chorus::app {

std::string version_text() {
  std::string s = std::string("chorus ") + CHORUS_VERSION + "\n";
#ifdef CHORUS_WITH_CUDA
  s += cuda::build_info();
#else
  s += "CUDA: no\ncuDNN: no\nNCCL: no\n";
#endif
#ifdef CHORUS_WITH_GLOO
  s += std::string("Gloo: ") + CHORUS_GLOO_VERSION + " (process groups on CPU tensors)\n";
#else
  s += "Gloo: no (no CPU process groups; install Debian's libgloo-dev and rebuild)\n";
#endif
#ifdef CHORUS_WITH_MPI
  s += std::string("MPI: ") + CHORUS_MPI_VERSION + " (mpirun-launched jobs are read from its environment)\n";
#else
  s += "MPI: no (mpirun launches still work when its environment is set)\n";
#endif
  s += "BLAS: OpenBLAS\n";
  return s;
}

int run_devices() {
  std::printf("cpu:0..cpu:%d  %d logical CPU devices (host memory; set CHORUS_CPU_DEVICES to change)\n",
              cpu_device_count() - 1, cpu_device_count());
  int n = cuda_device_count();
  if (n == 0) {
    std::printf("no CUDA GPU%s\n", has_backend(DeviceType::CUDA) ? "" : " (this build has no CUDA support)");
    return 0;
  }
#ifdef CHORUS_WITH_CUDA
  std::printf("%s", cuda::devices_report().c_str());
#endif
  return 0;
}

}  // namespace chorus::app
