// CLI11 helpers shared by the subcommands' option definitions. Kept apart
// from commands.h: CLI11's validators are global objects that every file
// including it compiles again (7 s of a 68-line file), so only the files that
// define options include it.
#pragma once

#include <optional>
#include <string>

#include <CLI/CLI.hpp>

namespace chorus::app {

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

}  // namespace chorus::app
