#include "chorus/parallel/pipeline_schedule.h"

#include <algorithm>
#include <map>
#include <tuple>

#include "chorus/core/error.h"

namespace chorus::parallel {

Schedule parse_schedule(const std::string& name) {
  if (name == "gpipe") return Schedule::GPipe;
  if (name == "1f1b") return Schedule::OneFOneB;
  if (name == "interleaved") return Schedule::Interleaved;
  CHORUS_THROW(ValueError, "unknown pipeline schedule '", name, "' (known: gpipe, 1f1b, interleaved)");
}

std::string schedule_name(Schedule s) {
  switch (s) {
    case Schedule::GPipe: return "gpipe";
    case Schedule::OneFOneB: return "1f1b";
    case Schedule::Interleaved: return "interleaved";
  }
  return "?";
}

std::string task_str(const PipeTask& t) {
  return std::string(t.kind == PipeTask::Forward ? "F(" : "B(") + std::to_string(t.stage) + "," +
         std::to_string(t.micro) + ")";
}

namespace {

using Lists = std::vector<std::vector<PipeTask>>;

// (local chunk, micro) pairs in Megatron's order: micro-batches in groups of
// D, each group through every chunk before the next group starts.
std::vector<std::pair<int, int>> chunk_order(int D, int v, int M, bool backward) {
  std::vector<std::pair<int, int>> out;
  for (int g0 = 0; g0 < M; g0 += D) {
    const int gs = std::min(D, M - g0);
    for (int c = 0; c < v; ++c)
      for (int j = 0; j < gs; ++j) out.emplace_back(backward ? v - 1 - c : c, g0 + j);
  }
  return out;
}

// Warm-up forwards, then one forward / one backward, then the remaining
// backwards: the 1F1B shape over given forward and backward orders.
std::vector<PipeTask> one_f_one_b(const std::vector<PipeTask>& fwd, const std::vector<PipeTask>& bwd, int warmup) {
  const int total = static_cast<int>(fwd.size());
  warmup = std::min(warmup, total);
  std::vector<PipeTask> out(fwd.begin(), fwd.begin() + warmup);
  int b = 0;
  for (int f = warmup; f < total; ++f) {
    out.push_back(fwd[static_cast<size_t>(f)]);
    out.push_back(bwd[static_cast<size_t>(b++)]);
  }
  for (; b < total; ++b) out.push_back(bwd[static_cast<size_t>(b)]);
  return out;
}

Lists build(Schedule schedule, int D, int v, int M, int extra_warmup) {
  Lists lists(static_cast<size_t>(D));
  for (int d = 0; d < D; ++d) {
    std::vector<PipeTask> fwd, bwd;
    if (schedule == Schedule::GPipe) {
      for (int m = 0; m < M; ++m)
        for (int c = 0; c < v; ++c) fwd.push_back({PipeTask::Forward, d + c * D, m});
      for (auto it = fwd.rbegin(); it != fwd.rend(); ++it) bwd.push_back({PipeTask::Backward, it->stage, it->micro});
      lists[static_cast<size_t>(d)] = fwd;
      lists[static_cast<size_t>(d)].insert(lists[static_cast<size_t>(d)].end(), bwd.begin(), bwd.end());
      continue;
    }
    for (auto [c, m] : chunk_order(D, v, M, false)) fwd.push_back({PipeTask::Forward, d + c * D, m});
    for (auto [c, m] : chunk_order(D, v, M, true)) bwd.push_back({PipeTask::Backward, d + c * D, m});
    const int warmup = v == 1 ? D - d - 1 : (D - d - 1) * 2 + (v - 1) * D;
    lists[static_cast<size_t>(d)] = one_f_one_b(fwd, bwd, warmup + extra_warmup);
  }
  return lists;
}

}  // namespace

Lists make_schedule(Schedule schedule, int devices, int stages, int micro_batches) {
  CHORUS_CHECK(devices >= 1, "pipeline: needs at least one device, got ", devices);
  CHORUS_CHECK(micro_batches >= 1, "pipeline: micro-batches must be at least 1, got ", micro_batches);
  CHORUS_CHECK(stages >= devices && stages % devices == 0, "pipeline: ", stages,
               " stages cannot be spread evenly over ", devices, " devices (stages must be a multiple of devices)");
  const int v = stages / devices;
  CHORUS_CHECK(schedule != Schedule::OneFOneB || v == 1, "pipeline: the 1f1b schedule runs one stage per device (",
               stages, " stages on ", devices, " devices); use the interleaved schedule for several");
  // Note [Schedules never deadlock].
  for (int extra = 0;; ++extra) {
    Lists lists = build(schedule, devices, v, micro_batches, extra);
    if (!simulate(lists, stages, micro_batches).deadlock) return lists;
    CHORUS_ASSERT(extra <= stages * micro_batches);
  }
}

SimulatedRun simulate(const Lists& lists, int stages, int micro_batches, double backward_cost) {
  const size_t S = static_cast<size_t>(stages), M = static_cast<size_t>(micro_batches);
  std::vector<double> f_end(S * M, -1), b_end(S * M, -1);
  std::vector<size_t> next(lists.size(), 0);
  std::vector<double> free_at(lists.size(), 0);
  std::vector<int> alive(lists.size(), 0);
  SimulatedRun run;
  run.max_in_flight.assign(lists.size(), 0);
  double busy = 0;
  size_t remaining = 0;
  for (const auto& l : lists) remaining += l.size();
  while (remaining > 0) {
    bool progress = false;
    for (size_t d = 0; d < lists.size(); ++d) {
      while (next[d] < lists[d].size()) {
        const PipeTask& t = lists[d][next[d]];
        const size_t at = static_cast<size_t>(t.stage) * M + static_cast<size_t>(t.micro);
        double ready = free_at[d];
        if (t.kind == PipeTask::Forward) {
          if (t.stage > 0) {
            const double dep = f_end[at - M];
            if (dep < 0) break;
            ready = std::max(ready, dep);
          }
        } else {
          if (f_end[at] < 0) break;
          ready = std::max(ready, f_end[at]);
          if (static_cast<size_t>(t.stage) + 1 < S) {
            const double dep = b_end[at + M];
            if (dep < 0) break;
            ready = std::max(ready, dep);
          }
        }
        const double cost = t.kind == PipeTask::Forward ? 1.0 : backward_cost;
        (t.kind == PipeTask::Forward ? f_end : b_end)[at] = ready + cost;
        free_at[d] = ready + cost;
        busy += cost;
        alive[d] += t.kind == PipeTask::Forward ? 1 : -1;
        run.max_in_flight[d] = std::max(run.max_in_flight[d], alive[d]);
        ++next[d];
        --remaining;
        progress = true;
      }
    }
    if (!progress) {
      run.deadlock = true;
      return run;
    }
  }
  run.makespan = *std::max_element(free_at.begin(), free_at.end());
  run.bubble = run.makespan > 0 ? 1.0 - busy / (static_cast<double>(lists.size()) * run.makespan) : 0.0;
  return run;
}

Lists forward_lists(int devices, int stages, int micro_batches) {
  Lists lists(static_cast<size_t>(devices));
  for (int m = 0; m < micro_batches; ++m)
    for (int s = 0; s < stages; ++s) lists[static_cast<size_t>(s % devices)].push_back({PipeTask::Forward, s, m});
  return lists;
}

std::string link_order_mismatch(const Lists& lists, int stages) {
  const int D = static_cast<int>(lists.size());
  // (direction, from device, to device) -> the (stage sent from, micro-batch) of each message, in order.
  using Key = std::tuple<int, int, int>;
  std::map<Key, std::vector<std::pair<int, int>>> sent, received;
  for (int d = 0; d < D; ++d)
    for (const PipeTask& t : lists[static_cast<size_t>(d)]) {
      const int s = t.stage;
      if (t.kind == PipeTask::Forward) {
        if (s > 0 && (s - 1) % D != d) received[{0, (s - 1) % D, d}].emplace_back(s - 1, t.micro);
        if (s + 1 < stages && (s + 1) % D != d) sent[{0, d, (s + 1) % D}].emplace_back(s, t.micro);
      } else {
        if (s + 1 < stages && (s + 1) % D != d) received[{1, (s + 1) % D, d}].emplace_back(s + 1, t.micro);
        if (s > 0 && (s - 1) % D != d) sent[{1, d, (s - 1) % D}].emplace_back(s, t.micro);
      }
    }
  for (const auto* side : {&sent, &received})
    for (const auto& [key, msgs] : *side) {
      const auto a = sent.find(key), b = received.find(key);
      if (a != sent.end() && b != received.end() && a->second == b->second) continue;
      const auto [dir, from, to] = key;
      return std::string(dir == 0 ? "activations" : "gradients") + " from device " + std::to_string(from) + " to " +
             std::to_string(to) + ": sent and received in different orders (or numbers)";
    }
  return "";
}

}  // namespace chorus::parallel
