#include "chorus/core/error.h"

#include <cstring>

namespace chorus {

namespace {
const char* basename_of(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash ? slash + 1 : path;
}
}  // namespace

Error::Error(const std::string& msg, const char* file, int line)
    : std::runtime_error(msg),
      message_(msg),
      what_(msg + " (" + basename_of(file) + ":" + std::to_string(line) + ")") {}

}  // namespace chorus
