// Progress reporting for long runs: a redrawn one-line bar when stderr is a
// terminal, plain periodic lines otherwise (logs, CI), so output stays readable
// either way.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace chorus::app {

struct ProgressFields {
  int64_t step = 0, total_steps = 0;
  int64_t epoch = 0, epochs = 0;
  double loss = 0, accuracy = 0, img_per_s = 0;
};

class Progress {
 public:
  explicit Progress(bool enabled);
  // Called whenever fresh figures are available (every log interval).
  void update(const ProgressFields& f);
  // Ends the bar line (before other output).
  void finish();
  static std::string format_duration(double seconds);

 private:
  bool enabled_;
  bool tty_;
  bool open_line_ = false;
  std::chrono::steady_clock::time_point start_, last_line_;
};

}  // namespace chorus::app
