// StepTracer: `--trace FILE.json [--trace-steps A-B]` for chorus train and
// chorus bench -- a Chrome / Perfetto timeline of a few chosen steps (Note
// [Step traces] in chorus/ops/profile.h; the file's layout in io/trace.h).
//
// Note [Traces of several ranks]: every rank records its own spans; when the
// last chosen step is done (or the run ends first) each rank other than 0
// puts its events, as JSON text, in the job's store under
// "chorus/trace/<rank>", and rank 0 reads them all (waiting at most the
// store's timeout) and writes the one file: one process id per rank. The
// store rather than files beside FILE, so that the ranks of several machines
// need no shared folder; the traces of a few steps are small (kilobytes to a
// few MB).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "chorus/distributed/store.h"

namespace chorus::app {

// "5-7" or "5": the first and last step (1-based, inclusive); ValueError
// naming `option` otherwise.
std::pair<int64_t, int64_t> parse_trace_steps(const std::string& text, const char* option = "--trace-steps");

class StepTracer {
 public:
  // `path` unset: a tracer that does nothing. Under a distributed job, `store`
  // and `rank`/`world` say where the ranks meet (rank 0 writes the file).
  // `announce`: one line on stderr naming the file once it is written.
  StepTracer(std::optional<std::string> path, const std::string& steps, dist::StorePtr store = nullptr, int rank = 0,
             int world = 1, bool announce = true);
  ~StepTracer();

  // Step `step` (1-based) is about to begin (its data loading counts):
  // recording starts when it is the first chosen one.
  void begin_step(int64_t step);
  // Step `step` has been issued: its span closes, and after the last chosen
  // step the file is written.
  void end_step(int64_t step);
  // The run is over: writes what was recorded if the last chosen step never came.
  void finish();

  bool enabled() const { return path_.has_value(); }

 private:
  void write();

  std::optional<std::string> path_;
  int64_t first_ = 0, last_ = 0;
  dist::StorePtr store_;
  int rank_ = 0, world_ = 1;
  bool announce_ = true, recording_ = false, written_ = false;
  std::chrono::steady_clock::time_point step_begin_;
};

}  // namespace chorus::app
