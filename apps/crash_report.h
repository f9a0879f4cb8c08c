// One line and a stack on stderr when `chorus` crashes.
//
// Note [Crash report]: a segmentation fault in a library (a CUDA driver call,
// cuDNN) otherwise ends the program with only the shell's "Segmentation
// fault" and exit status 139, and the GPU machines have no debugger. The
// handler writes which signal it was and the raw stack (backtrace_symbols_fd:
// async-signal-safe, no allocation), then restores the default action and
// raises the signal again, so the exit status and any core dump are the
// same as without it.
#pragma once

namespace chorus::app {

// Installs the handler for SIGSEGV, SIGBUS, SIGFPE and SIGILL (once).
void install_crash_report();

}  // namespace chorus::app
