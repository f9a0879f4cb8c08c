// JSON read from files a user or an attacker controls (checkpoint state.json,
// safetensors headers).
//
// Design note [Untrusted JSON]: nlohmann's parser is iterative, but copying,
// comparing and dump()ing a value recurse once per nesting level, so an
// array nested 100,000 deep overflows the stack the first time anything
// touches it. Readers therefore reject excessive nesting before parsing
// (a scan of the text, no recursion) and build error messages with
// json_excerpt(), which stops after a few dozen characters however large or
// deep the value is.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

namespace chorus::io::detail {

// The byte offset of the first '[' or '{' (outside strings) that opens
// level max_depth + 1, or nullopt when `text` nests no deeper than max_depth.
// Does not validate the JSON otherwise.
std::optional<size_t> find_excess_nesting(std::string_view text, int max_depth);

// The start of v.dump(), cut to about max_chars with "..." appended: for
// error messages about values read from a file.
std::string json_excerpt(const nlohmann::json& v, size_t max_chars = 60);

}  // namespace chorus::io::detail
