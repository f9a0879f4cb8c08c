#include "chorus/io/trace.h"

#include <algorithm>
#include <map>

#include "chorus/io/file_util.h"

namespace chorus::io {

namespace {

// Host first, then devices (CPU before CUDA, by index), communication (a
// backend's name, with a subgroup's label: "gloo tp"), other threads.
int track_rank(const std::string& track) {
  if (track == "host") return 0;
  if (track.rfind("host thread", 0) == 0) return 4;
  if (track == "gloo" || track == "nccl" || track.rfind("gloo ", 0) == 0 || track.rfind("nccl ", 0) == 0) return 3;
  return track.rfind("cuda", 0) == 0 ? 2 : 1;
}

}  // namespace

nlohmann::json trace_events(const std::vector<ops::TraceSpan>& spans, int rank) {
  std::vector<std::string> tracks = {"host"};
  for (const ops::TraceSpan& s : spans)
    if (std::find(tracks.begin(), tracks.end(), s.track) == tracks.end()) tracks.push_back(s.track);
  std::stable_sort(tracks.begin(), tracks.end(), [](const std::string& a, const std::string& b) {
    return track_rank(a) != track_rank(b) ? track_rank(a) < track_rank(b) : a < b;
  });
  std::map<std::string, int> tid;
  nlohmann::json events = nlohmann::json::array();
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", rank}, {"tid", 0},
                    {"args", {{"name", "rank " + std::to_string(rank)}}}});
  events.push_back({{"name", "process_sort_index"}, {"ph", "M"}, {"pid", rank}, {"tid", 0},
                    {"args", {{"sort_index", rank}}}});
  for (size_t i = 0; i < tracks.size(); ++i) {
    tid[tracks[i]] = static_cast<int>(i);
    const int kind = track_rank(tracks[i]);
    // Device tracks ("cuda:0 compute stream", Note [Device tracks]) are named already.
    const bool device_track = kind == 2 && tracks[i].find(' ') != std::string::npos;
    const std::string label = device_track ? tracks[i]
                              : kind == 1  ? tracks[i] + " kernels"
                              : kind == 2 ? tracks[i] + " kernel launches"
                              : kind == 3 ? tracks[i] + " collectives"
                                          : tracks[i];
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", rank}, {"tid", static_cast<int>(i)},
                      {"args", {{"name", label}}}});
    events.push_back({{"name", "thread_sort_index"}, {"ph", "M"}, {"pid", rank}, {"tid", static_cast<int>(i)},
                      {"args", {{"sort_index", static_cast<int>(i)}}}});
  }
  std::vector<const ops::TraceSpan*> order;
  for (const ops::TraceSpan& s : spans) order.push_back(&s);
  // By start; at equal starts the longer span first, so a viewer nests them.
  std::stable_sort(order.begin(), order.end(), [](const ops::TraceSpan* a, const ops::TraceSpan* b) {
    return a->start_us != b->start_us ? a->start_us < b->start_us : a->end_us > b->end_us;
  });
  for (const ops::TraceSpan* s : order) {
    nlohmann::json e = {{"name", s->name}, {"cat", s->category}, {"ph", "X"}, {"ts", s->start_us},
                        {"dur", std::max(0.0, s->end_us - s->start_us)}, {"pid", rank}, {"tid", tid[s->track]}};
    if (s->step >= 0) e["args"] = {{"step", s->step}};
    events.push_back(std::move(e));
  }
  return events;
}

void write_trace(const std::string& path, const std::vector<nlohmann::json>& per_rank_events) {
  nlohmann::json all = nlohmann::json::array();
  for (const nlohmann::json& events : per_rank_events)
    for (const nlohmann::json& e : events) all.push_back(e);
  nlohmann::json doc = {{"traceEvents", std::move(all)}, {"displayTimeUnit", "ms"}};
  detail::write_file_atomically(path, doc.dump() + "\n");
}

}  // namespace chorus::io
