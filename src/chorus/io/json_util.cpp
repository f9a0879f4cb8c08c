#include "chorus/io/json_util.h"

namespace chorus::io::detail {

std::optional<size_t> find_excess_nesting(std::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return i;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return std::nullopt;
}

namespace {

// Appends v's JSON text to *out until out->size() reaches `limit`. Each
// level adds at least one character, so the recursion is at most `limit` deep.
void excerpt(const nlohmann::json& v, std::string* out, size_t limit) {
  if (out->size() >= limit) return;
  if (v.is_array() || v.is_object()) {
    const bool object = v.is_object();
    *out += object ? '{' : '[';
    bool first = true;
    for (auto it = v.begin(); it != v.end() && out->size() < limit; ++it) {
      if (!first) *out += ", ";
      first = false;
      if (object) {
        excerpt(nlohmann::json(it.key().substr(0, limit)), out, limit);
        *out += ": ";
      }
      excerpt(*it, out, limit);
    }
    if (out->size() < limit) *out += object ? '}' : ']';
    return;
  }
  // A long string is cut before it is quoted, not after.
  const std::string s = v.is_string() ? nlohmann::json(v.get_ref<const std::string&>().substr(0, limit)).dump(
                                            -1, ' ', false, nlohmann::json::error_handler_t::replace)
                                      : v.dump();
  *out += s.substr(0, limit - out->size());
}

}  // namespace

std::string json_excerpt(const nlohmann::json& v, size_t max_chars) {
  std::string out;
  excerpt(v, &out, max_chars + 1);  // one past: a cut excerpt is longer than max_chars
  if (out.size() > max_chars) {
    out.resize(max_chars);
    out += "...";
  }
  return out;
}

}  // namespace chorus::io::detail
