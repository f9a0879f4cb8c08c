// The subcommands of the `chorus` program.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

#include "chorus/parallel/data_parallel.h"

namespace chorus::app {

std::string version_text();
// `git describe --always --dirty` of the source tree at build time ("unknown"
// outside a git checkout): chorus --version, chorus bench --json's rows.
std::string git_commit();
int run_devices();

// MiB from the command line as bytes (validated by the caller: >= 0), capped
// well below int64's range: a huge value just means one bucket.
inline int64_t mib_to_bytes(double mib) { return static_cast<int64_t>(std::min(mib * (1 << 20), 1e18)); }

// DataParallel's options for --bucket-mb and --last-bucket-mb (unset: the
// library's default).
inline parallel::DataParallelOptions dp_options(double bucket_mb, std::optional<double> last_bucket_mb = std::nullopt) {
  parallel::DataParallelOptions o;
  o.bucket_bytes = mib_to_bytes(bucket_mb);
  if (last_bucket_mb) o.last_bucket_bytes = mib_to_bytes(*last_bucket_mb);
  return o;
}

}  // namespace chorus::app
