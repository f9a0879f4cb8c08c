#include "chorus/core/persistent_alloc.h"

namespace chorus {

namespace {
thread_local bool t_persistent = false;
}  // namespace

PersistentAllocations::PersistentAllocations() : prev_(t_persistent) { t_persistent = true; }
PersistentAllocations::~PersistentAllocations() { t_persistent = prev_; }
bool PersistentAllocations::active() noexcept { return t_persistent; }

}  // namespace chorus
