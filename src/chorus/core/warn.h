// Warnings: one line on stderr, "chorus: warning: ...", from any thread
// without interleaving. warn_once says a thing once per process per key (a
// parameter copied across devices every step is worth one line, not one per
// step). Library code warns instead of printing ad hoc, and never throws from
// a destructor: it warns there.
#pragma once

#include <string>

#include "chorus/core/error.h"

namespace chorus {

void warn(const std::string& message);
// True when this call printed (the first for `key`).
bool warn_once(const std::string& key, const std::string& message);

template <typename... Args>
void warnf(const Args&... args) {
  warn(detail::str_cat(args...));
}

}  // namespace chorus
