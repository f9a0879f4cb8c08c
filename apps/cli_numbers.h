// Strict numbers for command-line options.
//
// CLI11 2.1 reads "010" as octal 8, "0x10" as 16 and "" as 0, wraps "-5"
// into an unsigned option, and clamps out-of-range values. These validators
// run before its conversion: an integer must be decimal digits within a
// range (rewritten without leading zeros, so CLI11 then reads exactly that
// number), a real number must be a whole, finite decimal within a range.
// Anything else is an error naming the option and the accepted range.
#pragma once

#include <CLI/CLI.hpp>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace chorus::app {

// Bounds past any real run, well inside int64 (steps = epochs x batches).
inline constexpr uint64_t kMaxEpochs = 1'000'000;
inline constexpr uint64_t kMaxSteps = 1'000'000'000'000'000;
inline constexpr uint64_t kMaxBatchSize = 1u << 24;
inline constexpr uint64_t kMaxSyntheticSize = 100'000'000;

// A whole number in [min, max] (max at most 2^64 - 1).
inline CLI::Validator whole_number(uint64_t min, uint64_t max) {
  const std::string range = "a whole number from " + std::to_string(min) + " to " + std::to_string(max);
  return CLI::Validator(
      [min, max, range](std::string& s) -> std::string {
        uint64_t v = 0;
        const bool digits = !s.empty() && s.find_first_not_of("0123456789") == std::string::npos;
        auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
        if (!digits || ec != std::errc() || ptr != s.data() + s.size() || v < min || v > max)
          return "'" + s + "' is not " + range;
        s = std::to_string(v);  // no leading zeros: CLI11 would read them as octal
        return std::string();
      },
      "INT in [" + std::to_string(min) + ", " + std::to_string(max) + "]");
}

// A whole number, possibly negative, at most `max`. The lower bound is the
// option's own check (TrainConfig::validate: "must be positive, got 0").
inline CLI::Validator integer_up_to(int64_t max) {
  const std::string range = "a whole number up to " + std::to_string(max);
  return CLI::Validator(
      [max, range](std::string& s) -> std::string {
        int64_t v = 0;
        const size_t sign = !s.empty() && s[0] == '-';
        const bool digits = s.size() > sign && s.find_first_not_of("0123456789", sign) == std::string::npos;
        auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
        if (!digits || ec != std::errc() || ptr != s.data() + s.size() || v > max) return "'" + s + "' is not " + range;
        s = std::to_string(v);  // no leading zeros: CLI11 would read them as octal
        return std::string();
      },
      "INT <= " + std::to_string(max));
}

// A finite real number at most `max` (below it when max_open); not below
// `min` when one is given (else the option's own check says so).
inline CLI::Validator real_number(double max, bool max_open = false, double min = -HUGE_VAL) {
  auto fmt = [](double x) {
    std::string t = std::to_string(x);
    while (t.find('.') != std::string::npos && (t.back() == '0' || t.back() == '.')) t.pop_back();
    return t;
  };
  const std::string range = std::string("a number ") + (std::isfinite(min) ? "from " + fmt(min) + " " : "") +
                            (max_open ? "below " : (std::isfinite(min) ? "to " : "up to ")) + fmt(max);
  return CLI::Validator(
      [=](std::string& s) -> std::string {
        const char* b = s.c_str();
        char* end = nullptr;
        const double v = s.empty() || std::isspace(static_cast<unsigned char>(s[0])) ? NAN : std::strtod(b, &end);
        if (s.empty() || end != b + s.size() || !std::isfinite(v) || v < min || v > max || (max_open && v == max))
          return "'" + s + "' is not " + range;
        return std::string();
      },
      std::string("NUMBER ") + (max_open ? "< " : "<= ") + fmt(max));
}

}  // namespace chorus::app
