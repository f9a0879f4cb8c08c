// See threads.h.
#include "chorus/ops/threads.h"

#include "chorus/core/error.h"
#include "chorus/cpu/parallel.h"

namespace chorus {

int cpu_threads() { return cpu::num_threads(); }

void set_cpu_threads(int n) {
  CHORUS_CHECK_T(ValueError, n >= 1, "set_cpu_threads: need at least 1 thread, got ", n);
  cpu::set_num_threads(n);
}

bool cpu_threads_from_environment() { return cpu::num_threads_set_by_user(); }

}  // namespace chorus
