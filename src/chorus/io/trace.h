// Chrome / Perfetto trace files (the JSON trace-event format that
// chrome://tracing, ui.perfetto.dev and speedscope open) from the spans of
// ops::start_trace (Note [Step traces] in ops/profile.h).
//
// Layout: one process id per rank (named "rank N"), and in it one thread id
// per track: 0 is the host thread that runs the steps (step and phase spans),
// then each device's kernels ("cpu:0 kernels", "cuda:1 kernel launches"), a
// GPU's own tracks after its launches ("cuda:1 compute stream", "cuda:1 nccl
// stream", "cuda:1 copies": Note [Device tracks] in ops/device_trace.h), the
// Gloo worker's collectives ("gloo collectives"), then other host threads. Spans are complete
// events ("ph": "X") with microsecond timestamps from the system clock, so
// the ranks of a job on one machine line up exactly, and those of several
// machines as well as their clocks agree.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "chorus/ops/profile.h"

namespace chorus::io {

// The trace events of one rank: its name and track metadata, then its spans
// sorted by start time.
nlohmann::json trace_events(const std::vector<ops::TraceSpan>& spans, int rank);

// Writes {"traceEvents": [every rank's events], "displayTimeUnit": "ms"}
// atomically; IOError naming the file when it cannot.
void write_trace(const std::string& path, const std::vector<nlohmann::json>& per_rank_events);

}  // namespace chorus::io
