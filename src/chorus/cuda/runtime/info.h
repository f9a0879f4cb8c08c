// Build and device information for `chorus --version` and `chorus devices`.
#pragma once

#include <string>

namespace chorus::cuda {

// "CUDA: 13.0 (driver 13.0)\ncuDNN: 9.x\nNCCL: 2.x\n" — versions or "no".
std::string build_info();
// One line per GPU (name, memory, compute capability) and the peer/NVLink matrix.
std::string devices_report();

}  // namespace chorus::cuda
