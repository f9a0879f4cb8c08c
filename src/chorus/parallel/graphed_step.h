// GraphedStep: a whole training step (forward, backward, optimizer) captured
// once as a CUDA graph and replayed (PyTorch's torch.cuda.graphs /
// make_graphed_callables, CUDA-graph "reduce-overhead" mode).
//
//   parallel::GraphedStep step([&](const std::vector<Tensor>& in) {
//     Tensor loss = nn::functional::cross_entropy(model->forward(in[0]), in[1]);
//     opt.zero_grad();
//     loss.backward();
//     opt.step();
//     return std::vector<Tensor>{loss};
//   });
//   for (auto& [x, y] : batches) Tensor loss = step({x, y})[0];
//
// Note [Graphed step]: the first `warmup_steps` calls run the function
// eagerly (optimizer state, cuDNN plans and caches get made there); the next
// call copies its inputs into static buffers and captures the function on a
// stream of its own (Note [CUDA graphs] in core/graph_capture.h), then
// replays the graph. Every later call copies its inputs into the static
// buffers, replays, runs the step's host bookkeeping (on_each_replay) and
// returns copies of the outputs, so a returned tensor is never overwritten by
// a later replay. The function must do the same device work every time:
// shapes fixed by the inputs, no branch on tensor values. What breaks that is
// caught, not replayed wrongly:
//   - a call whose inputs differ in shape, dtype or device from the captured
//     ones runs eagerly (a last, smaller batch); the graph stays for the next;
//   - a function that cannot be captured (reads a value on the host, draws
//     random numbers, changes the learning rate inside, spans several
//     devices, ...) throws CaptureError during the capture: the step says so
//     in one line, through on_fallback, and runs eagerly from then on;
//   - inputs on the CPU: graphs do not apply and the step is simply eager.
// The learning rate may change between calls (Optimizer::set_lr writes the
// optimizer's device scalars, which the graph reads).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "chorus/core/backend.h"
#include "chorus/core/stream.h"
#include "chorus/core/tensor.h"

namespace chorus::parallel {

struct GraphedStepOptions {
  bool enabled = true;   // false: every call eager (chorus train --no-cuda-graphs)
  int warmup_steps = 2;  // eager calls before the capture
  // The CUDA devices the step's work runs on, the inputs' device first
  // (DataParallel: its devices); empty: the inputs' device alone. One graph
  // spans them all: the other devices' streams fork from the first device's
  // capture and join back before it ends, the step's device threads issuing
  // to them (DeviceThreadPool carries the caller's streams).
  std::vector<Device> devices;
  // Receives the one line that says why the step runs eagerly (capture failed,
  // or the first shape change); null: a warning on stderr.
  std::function<void(const std::string&)> on_fallback;
};

class GraphedStep {
 public:
  using Fn = std::function<std::vector<Tensor>(const std::vector<Tensor>& inputs)>;
  explicit GraphedStep(Fn fn, GraphedStepOptions options = {});
  ~GraphedStep();
  GraphedStep(const GraphedStep&) = delete;
  GraphedStep& operator=(const GraphedStep&) = delete;

  std::vector<Tensor> operator()(const std::vector<Tensor>& inputs);

  // Whether a graph has been captured (later calls with the same shapes replay it).
  bool captured() const { return graph_ != nullptr; }
  // Why the step runs eagerly for good ("" while it may still be captured or is).
  const std::string& fallback_reason() const { return reason_; }
  int64_t replays() const { return replays_; }
  int64_t eager_calls() const { return eager_calls_; }

 private:
  std::vector<Tensor> eager(const std::vector<Tensor>& inputs);
  void capture(const std::vector<Tensor>& inputs, std::string* first_error);
  std::vector<Tensor> replay(const std::vector<Tensor>& inputs);
  bool matches(const std::vector<Tensor>& inputs) const;
  void say(const std::string& line);
  // The graph's streams start after the caller's work on every device.
  void wait_for_callers();

  Fn fn_;
  GraphedStepOptions options_;
  int64_t calls_ = 0, replays_ = 0, eager_calls_ = 0;
  std::string reason_;
  bool said_shape_ = false;
  std::vector<Device> devices_;     // [0]: the inputs' device, where the capture begins
  std::vector<Stream> streams_;     // the graph's stream on each device
  std::vector<Event> ready_;        // per device: the caller's work so far
  std::optional<Event> replayed_;   // on devices_[0]: the end of a replay
  std::vector<Tensor> static_inputs_, static_outputs_;
  std::vector<std::function<void()>> actions_;  // host bookkeeping per replay
  std::vector<std::function<void()>> checks_;   // must pass before each replay (before_each_replay)
  DeviceBackend::GraphHandle graph_ = nullptr;
};

}  // namespace chorus::parallel
