#include "chorus/core/warn.h"

#include <cstdio>
#include <mutex>
#include <set>

namespace chorus {

namespace {
std::mutex& warn_mutex() {
  static auto* mu = new std::mutex;  // leaked: destructors warn during static destruction
  return *mu;
}
}  // namespace

void warn(const std::string& message) {
  std::lock_guard<std::mutex> lock(warn_mutex());
  std::fprintf(stderr, "chorus: warning: %s\n", message.c_str());
  std::fflush(stderr);  // a warning right before a crash must not be lost
}

bool warn_once(const std::string& key, const std::string& message) {
  static auto* seen = new std::set<std::string>;
  {
    std::lock_guard<std::mutex> lock(warn_mutex());
    if (!seen->insert(key).second) return false;
  }
  warn(message);
  return true;
}

}  // namespace chorus
