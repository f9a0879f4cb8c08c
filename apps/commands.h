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

// DataParallel's options for --bucket-mb, --last-bucket-mb and
// --dp-all-reduce (unset: the library's default), and the A/B switches of its
// gradient sums, read from the environment here and nowhere in the library
// (apps/dp_options.cpp lists them). ValueError for a bad value.
parallel::DataParallelOptions dp_options(double bucket_mb, std::optional<double> last_bucket_mb = std::nullopt,
                                         const std::optional<std::string>& all_reduce = std::nullopt);

}  // namespace chorus::app
