#include "progress.h"

#include <unistd.h>

#include <cstdio>

namespace chorus::app {

Progress::Progress(bool enabled)
    : enabled_(enabled), tty_(isatty(STDERR_FILENO) != 0),
      start_(std::chrono::steady_clock::now()), last_line_(start_) {}

std::string Progress::format_duration(double s) {
  if (s < 0 || s != s) return "?";
  char buf[32];
  int64_t t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600) std::snprintf(buf, sizeof buf, "%lldh%02lldm", (long long)(t / 3600), (long long)(t / 60 % 60));
  else std::snprintf(buf, sizeof buf, "%lldm%02llds", (long long)(t / 60), (long long)(t % 60));
  return buf;
}

void Progress::update(const ProgressFields& f) {
  if (!enabled_) return;
  auto now = std::chrono::steady_clock::now();
  double elapsed = std::chrono::duration<double>(now - start_).count();
  double eta = f.step > 0 ? elapsed * static_cast<double>(f.total_steps - f.step) / static_cast<double>(f.step) : -1;
  if (tty_) {
    const int width = 24;
    int filled = f.total_steps ? static_cast<int>(width * f.step / f.total_steps) : 0;
    std::string bar(filled, '#');
    bar += std::string(width - filled, '.');
    std::fprintf(stderr, "\r[%s] step %lld/%lld  epoch %lld/%lld  loss %.4f  acc %.3f  %.0f img/s  ETA %s   ",
                 bar.c_str(), (long long)f.step, (long long)f.total_steps, (long long)f.epoch, (long long)f.epochs,
                 f.loss, f.accuracy, f.img_per_s, format_duration(eta).c_str());
    std::fflush(stderr);
    open_line_ = true;
    return;
  }
  // Not a terminal: one line at most every 10 s (and always the last step).
  if (f.step != f.total_steps && std::chrono::duration<double>(now - last_line_).count() < 10.0) return;
  last_line_ = now;
  std::fprintf(stderr, "step %lld/%lld epoch %lld/%lld loss %.4f acc %.3f img/s %.0f eta %s\n", (long long)f.step,
               (long long)f.total_steps, (long long)f.epoch, (long long)f.epochs, f.loss, f.accuracy, f.img_per_s,
               format_duration(eta).c_str());
  std::fflush(stderr);
}

void Progress::finish() {
  if (open_line_) std::fputc('\n', stderr);
  open_line_ = false;
}

}  // namespace chorus::app
