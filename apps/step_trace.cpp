#include "step_trace.h"

#include <cstdio>

#include "chorus/core/error.h"
#include "chorus/io/trace.h"
#include "chorus/ops/profile.h"

namespace chorus::app {

std::pair<int64_t, int64_t> parse_trace_steps(const std::string& text, const char* option) {
  auto number = [&](const std::string& s) {
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(s, &used);
    } catch (...) {
      used = 0;
    }
    CHORUS_CHECK(used > 0 && used == s.size() && v >= 1, option, ": expected a step or a range such as 5-7 (steps count from 1), got '", text, "'");
    return static_cast<int64_t>(v);
  };
  const size_t dash = text.find('-');
  const int64_t a = number(text.substr(0, dash));
  const int64_t b = dash == std::string::npos ? a : number(text.substr(dash + 1));
  CHORUS_CHECK(b >= a, option, ": the range ", text, " ends before it begins");
  CHORUS_CHECK(b - a < 1000, option, ": ", text, " is more than 1000 steps (a trace is for a few)");
  return {a, b};
}

StepTracer::StepTracer(std::optional<std::string> path, const std::string& steps, dist::StorePtr store, int rank,
                       int world, bool announce)
    : path_(std::move(path)), store_(std::move(store)), rank_(rank), world_(world), announce_(announce) {
  std::tie(first_, last_) = parse_trace_steps(steps);
}

StepTracer::~StepTracer() {
  if (recording_) ops::stop_trace();
}

void StepTracer::begin_step(int64_t step) {
  if (!path_ || written_ || step < first_ || step > last_) return;
  if (!recording_) {
    (void)ops::take_trace();  // nothing from before the chosen steps
    ops::start_trace();
    recording_ = true;
  }
  ops::set_trace_step(step);
  step_begin_ = std::chrono::steady_clock::now();
}

void StepTracer::end_step(int64_t step) {
  if (!recording_ || step < first_ || step > last_) return;
  const std::string name = "step " + std::to_string(step);
  ops::trace_host_span(name.c_str(), "step", step_begin_, std::chrono::steady_clock::now());
  if (step == last_) write();
}

void StepTracer::finish() {
  if (path_ && !written_) write();
}

void StepTracer::write() {
  written_ = true;
  ops::stop_trace(/*wait_for_devices=*/true);
  recording_ = false;
  const std::vector<ops::TraceSpan> spans = ops::take_trace();
  nlohmann::json mine = io::trace_events(spans, rank_);
  if (world_ > 1 && rank_ != 0) {
    store_->set("chorus/trace/" + std::to_string(rank_), mine.dump());
    return;
  }
  std::vector<nlohmann::json> all = {std::move(mine)};
  for (int r = 1; r < world_; ++r) all.push_back(nlohmann::json::parse(store_->get_string("chorus/trace/" + std::to_string(r))));
  io::write_trace(*path_, all);
  if (announce_)
    std::fprintf(stderr, "trace: %s (steps %lld-%lld, %zu spans%s)\n", path_->c_str(), (long long)first_, (long long)last_,
               spans.size(), world_ > 1 ? (" on rank 0, " + std::to_string(world_) + " ranks").c_str() : "");
}

}  // namespace chorus::app
