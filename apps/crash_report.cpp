// Note [Crash report] (crash_report.h).
#include "crash_report.h"

#include <execinfo.h>
#include <unistd.h>

#include <csignal>
#include <cstring>

namespace chorus::app {

namespace {

void write_str(const char* s) { (void)!::write(STDERR_FILENO, s, std::strlen(s)); }

void on_crash(int sig) {
  const char* name = sig == SIGSEGV ? "SIGSEGV (segmentation fault)"
                     : sig == SIGBUS ? "SIGBUS (bus error)"
                     : sig == SIGFPE ? "SIGFPE (arithmetic error)"
                                     : "SIGILL (illegal instruction)";
  write_str("chorus: crashed with ");
  write_str(name);
  write_str("; stack (addr2line -f -C -e FILE OFFSET names a frame):\n");
  void* frames[64];
  const int n = ::backtrace(frames, 64);
  ::backtrace_symbols_fd(frames, n, STDERR_FILENO);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

}  // namespace

void install_crash_report() {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  return;  // the sanitizer's own report says more
#endif
  static bool installed = false;
  if (installed) return;
  installed = true;
  void* warm[1];
  ::backtrace(warm, 1);  // loads libgcc's unwinder now, not inside the handler
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL}) std::signal(sig, on_crash);
}

}  // namespace chorus::app
