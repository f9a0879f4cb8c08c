// Pipeline schedules: in which order each device runs the forward and
// backward of each (stage, micro-batch). Pure bookkeeping, no tensors: the
// Pipeline (parallel/pipeline.h) executes these lists, one host thread per
// device, each task waiting only for the tasks it depends on:
//   F(s, m) needs F(s-1, m);   B(s, m) needs F(s, m) and B(s+1, m).
//
// Stage s lives on device s % D (D devices, S = D * v stages, v "virtual"
// stages per device for the interleaved schedule).
//
//   GPipe        every forward, then every backward (in reverse): M micro-
//                batches' activations alive at once on every device.
//   1F1B         PipeDream-flush: device d runs D - d - 1 warm-up forwards,
//                then alternates one forward, one backward; at most D - d
//                micro-batches alive on device d, the same bubble as GPipe.
//   interleaved  Megatron-LM's interleaved 1F1B: v stages per device, taken
//                in groups of D micro-batches, so the bubble shrinks by v.
//
// Note [Schedules never deadlock]: a list for every device is only accepted
// if simulate() runs it to the end; the interleaved order is Megatron's when
// M is a multiple of D and otherwise may need a longer warm-up, which
// make_schedule finds by simulation (all-forwards-first always works).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace chorus::parallel {

enum class Schedule { GPipe, OneFOneB, Interleaved };

// "gpipe", "1f1b", "interleaved"; ValueError naming the known ones.
Schedule parse_schedule(const std::string& name);
std::string schedule_name(Schedule s);

struct PipeTask {
  enum Kind : uint8_t { Forward, Backward };
  Kind kind;
  int stage;
  int micro;
  bool operator==(const PipeTask& o) const { return kind == o.kind && stage == o.stage && micro == o.micro; }
};
std::string task_str(const PipeTask& t);  // "F(1,3)"

// One ordered task list per device. ValueError on sizes that make no sense
// (no device, no micro-batch, stages not a multiple of devices, 1F1B with
// more than one stage per device).
std::vector<std::vector<PipeTask>> make_schedule(Schedule schedule, int devices, int stages, int micro_batches);

// Runs the lists with unit-time forwards and `backward_cost`-time backwards,
// every device as soon as its next task's inputs are there.
struct SimulatedRun {
  bool deadlock = false;
  double makespan = 0;               // time until the last task ends
  double bubble = 0;                 // 1 - busy / (devices * makespan)
  std::vector<int> max_in_flight;    // per device: most micro-batch stages forwarded but not yet backwarded
};
SimulatedRun simulate(const std::vector<std::vector<PipeTask>>& lists, int stages, int micro_batches,
                      double backward_cost = 2.0);

// The lists of a forwards-only pass (evaluation): every micro-batch through
// the stages in micro-batch order, each stage's forwards on its device.
std::vector<std::vector<PipeTask>> forward_lists(int devices, int stages, int micro_batches);

// When stages run on devices that talk by send/recv (Note [Pipeline links]
// in parallel/pipeline_links.h), each ordered pair of devices (a link) carries, per direction, the
// activations (F(s) on device a to F(s+1) on device b) or gradients (B(s) on
// a to B(s-1) on b) in the order device a issues them; the receiver takes
// them in the order its list needs them. "" when, on every link and in each
// direction, the two orders are the same (a FIFO channel delivers each
// message where it is wanted); else the first link whose orders differ.
std::string link_order_mismatch(const std::vector<std::vector<PipeTask>>& lists, int stages);

}  // namespace chorus::parallel
