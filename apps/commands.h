// The subcommands of the `chorus` program.
#pragma once

#include <algorithm>
#include <string>

#include "chorus/parallel/data_parallel.h"

namespace chorus::app {

std::string version_text();
int run_devices();

// DataParallel's options for --bucket-mb (validated by the caller: >= 0).
inline parallel::DataParallelOptions dp_options(double bucket_mb) {
  parallel::DataParallelOptions o;
  // Capped well below int64's range: a huge value just means one bucket.
  o.bucket_bytes = static_cast<int64_t>(std::min(bucket_mb * (1 << 20), 1e18));
  return o;
}

}  // namespace chorus::app
