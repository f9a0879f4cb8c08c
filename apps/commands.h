// The subcommands of the `chorus` program.
#pragma once

#include <algorithm>
#include <optional>
#include <string>

#include <CLI/CLI.hpp>

#include "chorus/parallel/data_parallel.h"

namespace chorus::app {

std::string version_text();
int run_devices();

// CLI11 check for --devices: an explicitly empty list is an error (leaving the
// option out picks the default device instead).
inline std::string non_empty_devices(const std::string& v) {
  if (v.find_first_not_of(" ,") == std::string::npos)
    return "empty device list: name devices (cpu:0,cpu:1 or cuda:0,cuda:1, or all) or leave --devices out";
  return std::string();
}

// An option without a natural default value: left out, `into` stays unset and
// the command picks its default; given, the value is stored as it is and
// checked like any other (an empty string or -1 is never read as "unset").
template <typename T>
CLI::Option* add_optional(CLI::App* cmd, const std::string& name, std::optional<T>& into, const std::string& help) {
  return cmd->add_option_function<T>(name, [&into](const T& v) { into = v; }, help);
}

// DataParallel's options for --bucket-mb (validated by the caller: >= 0).
inline parallel::DataParallelOptions dp_options(double bucket_mb) {
  parallel::DataParallelOptions o;
  // Capped well below int64's range: a huge value just means one bucket.
  o.bucket_bytes = static_cast<int64_t>(std::min(bucket_mb * (1 << 20), 1e18));
  return o;
}

}  // namespace chorus::app
