// How many CPU threads one op uses (Chorus's parallel loops and OpenBLAS).
#pragma once

namespace chorus {

// CHORUS_NUM_THREADS when set, else the hardware threads, until changed.
int cpu_threads();

// For the rest of the process (n >= 1; ValueError otherwise). Several
// processes on one machine each training on the CPU (DDP over Gloo) should
// share the cores instead of each taking all of them: init_process_group
// does this by itself (Note [Cores shared by local ranks]).
void set_cpu_threads(int n);

// True when CHORUS_NUM_THREADS is set: the user's choice, which automatic
// settings leave alone.
bool cpu_threads_from_environment();

}  // namespace chorus
