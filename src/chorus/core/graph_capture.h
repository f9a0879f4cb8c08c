// The bookkeeping of a CUDA graph capture that device-independent code needs:
// whether one is in progress, and the host-side effects of a captured step.
//
// Note [CUDA graphs]: a captured step (parallel/graphed_step.h) is a CUDA
// graph recorded once from a normal eager step and replayed afterwards: the
// replay repeats the device work with the same addresses and the same kernel
// arguments, and none of the host work. So a captured step must
//   - keep every value that changes from step to step in device memory (the
//     batch: static input buffers; the learning rate and AdamW's step count:
//     the optimizer's device scalars, Note [Optimizer scalars on the device]);
//   - do its host-side bookkeeping (step counters) once per replay, not once
//     at capture: such code calls on_each_replay();
//   - never need the host in the middle: reading a tensor on the host,
//     copying host memory to the device, synchronising, drawing random
//     numbers with a host-side counter, or creating state on a first step all
//     throw CaptureError, and the graphed step then runs eagerly with one
//     message naming what could not be captured (never a wrong result).
// Memory allocated during a capture comes from a pool private to the graph
// (cuda/graph_pool.h), so replays find it where the capture left it.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace chorus {

// Whether a graph capture is in progress anywhere in the process (cheap: one
// atomic load). Only one capture runs at a time.
bool capture_in_progress() noexcept;

// Throws CaptureError("<what> cannot be part of a CUDA graph ...") when a
// capture is in progress; the graphed step falls back to eager on it.
void check_not_capturing(const char* what);

// Host-side state changes of a step (counters, state that mirrors the device):
// runs `action` now when no capture is in progress; during a capture, keeps it
// and the graphed step runs it after each replay instead (the first replay
// included). A failed capture discards it, so the eager rerun does it once.
void on_each_replay(std::function<void()> action);

// A check that must pass before each replay (e.g. that a communicator the
// graph's collectives use has not been aborted: replaying them then would
// touch freed resources). Runs `check` now when no capture is in progress;
// during a capture, keeps it and the graphed step runs it before each replay,
// where what it throws reaches the caller and the graph is not launched.
void before_each_replay(std::function<void()> check);

// Counts the captures begun in this process (0 before the first): lets code
// register a per-capture action once however often it runs inside one.
uint64_t capture_generation() noexcept;

// The first CUDA, cuDNN or NCCL error raised during the capture in progress
// (not the "invalidated by a previous error" that every later call reports):
// why a capture failed, whichever thread or call noticed it first. The error
// checks note it; a graphed step that falls back names it.
void note_capture_error(const std::string& what);
std::string first_capture_error();

// RAII, held by the graphed step while it captures: marks the capture in
// progress and collects the on_each_replay() actions of any thread.
class CaptureScope {
 public:
  CaptureScope();
  ~CaptureScope();
  CaptureScope(const CaptureScope&) = delete;
  CaptureScope& operator=(const CaptureScope&) = delete;
  // The actions collected so far, in the order they were registered.
  std::vector<std::function<void()>> take_actions();
  // The before_each_replay() checks collected so far, in registration order.
  std::vector<std::function<void()>> take_checks();
};

}  // namespace chorus
