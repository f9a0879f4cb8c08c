#include "chorus/core/error.h"

#include <mutex>

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

namespace chorus {

namespace {
std::mutex& failure_mutex() {
  static auto* mu = new std::mutex;
  return *mu;
}
std::string& failure_message() {
  static auto* m = new std::string;
  return *m;
}
}  // namespace

void set_distributed_failure(const std::string& message) {
  std::lock_guard<std::mutex> lk(failure_mutex());
  if (failure_message().empty()) failure_message() = message;
}

std::string distributed_failure() {
  std::lock_guard<std::mutex> lk(failure_mutex());
  return failure_message();
}

}  // namespace chorus
