#include "chorus/parallel/graphed_step.h"

#include <memory>
#include <sstream>
#include <utility>

#include "chorus/autograd/grad_mode.h"
#include "chorus/core/error.h"
#include "chorus/core/graph_capture.h"
#include "chorus/core/warn.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/device_trace.h"
#include "chorus/ops/profile.h"

namespace chorus::parallel {

namespace {

std::string shape_str(const Tensor& t) {
  std::ostringstream os;
  os << "[";
  for (int64_t i = 0; i < t.dim(); ++i) os << (i ? "," : "") << t.size(i);
  os << "]";
  return os.str();
}

}  // namespace

GraphedStep::GraphedStep(Fn fn, GraphedStepOptions options) : fn_(std::move(fn)), options_(std::move(options)) {
  CHORUS_CHECK(fn_ != nullptr, "GraphedStep: the step function is empty");
  CHORUS_CHECK(options_.warmup_steps >= 0, "GraphedStep: warmup_steps must be >= 0, got ", options_.warmup_steps);
}

GraphedStep::~GraphedStep() {
  // The tensors made in the graph's pool go first, so that the pool's memory
  // can go with the graph (unless tensors such as gradients still hold some).
  static_outputs_.clear();
  static_inputs_.clear();
  if (graph_) backend(devices_[0]).graph_destroy(devices_[0], graph_);
}

void GraphedStep::say(const std::string& line) {
  if (options_.on_fallback) options_.on_fallback(line);
  else warn(line);
}

std::vector<Tensor> GraphedStep::eager(const std::vector<Tensor>& inputs) {
  ++eager_calls_;
  return fn_(inputs);
}

bool GraphedStep::matches(const std::vector<Tensor>& inputs) const {
  if (inputs.size() != static_inputs_.size()) return false;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& a = inputs[i];
    const Tensor& b = static_inputs_[i];
    if (a.device() != b.device() || a.dtype() != b.dtype() || a.sizes() != b.sizes() || a.strides() != b.strides())
      return false;
  }
  return true;
}

std::vector<Tensor> GraphedStep::operator()(const std::vector<Tensor>& inputs) {
  ++calls_;
  if (!options_.enabled || !reason_.empty()) return eager(inputs);
  if (graph_) {
    if (matches(inputs)) return replay(inputs);
    if (!said_shape_) {
      said_shape_ = true;
      std::string got, want;
      for (const Tensor& t : inputs) got += (got.empty() ? "" : " ") + shape_str(t);
      for (const Tensor& t : static_inputs_) want += (want.empty() ? "" : " ") + shape_str(t);
      say("CUDA graphs: a step with inputs " + got + " (the graph has " + want +
          ") runs eagerly; such steps always will");
    }
    return eager(inputs);
  }
  // Graphs hold the work of one CUDA device: every input must be on it.
  std::optional<Device> dev;
  for (const Tensor& t : inputs) {
    if (!t.defined()) continue;
    if (!dev) dev = t.device();
    if (t.device() != *dev || !t.device().is_cuda()) {
      reason_ = "CUDA graphs need every input on one CUDA device (got " + t.device().str() + ")";
      return eager(inputs);
    }
  }
  if (!dev) {
    reason_ = "CUDA graphs need tensor inputs";
    return eager(inputs);
  }
  std::vector<Device> devices = options_.devices.empty() ? std::vector<Device>{*dev} : options_.devices;
  for (const Device& d : devices) {
    if (!d.is_cuda()) {
      reason_ = "CUDA graphs need CUDA devices (the step runs on " + d.str() + ")";
      return eager(inputs);
    }
  }
  if (devices[0] != *dev) {
    reason_ = "the inputs are on " + dev->str() + ", not on the step's first device " + devices[0].str();
    return eager(inputs);
  }
  if (calls_ <= options_.warmup_steps) return eager(inputs);
  std::string first_error;
  try {
    devices_ = devices;
    capture(inputs, &first_error);
  } catch (const CaptureError& e) {
    reason_ = e.message();
  } catch (const Error& e) {
    // Anything else thrown while capturing (a CUDA call refused inside the
    // capture): the eager run below says whether it is a real error.
    reason_ = e.message();
  }
  // What broke the capture first, when what was thrown is only its echo.
  if (!reason_.empty() && !first_error.empty() && reason_.find(first_error) == std::string::npos)
    reason_ += "; the first error in the capture: " + first_error;
  if (!reason_.empty()) {
    static_inputs_.clear();
    static_outputs_.clear();
    say("CUDA graphs: this step cannot be captured (" + reason_ + "); it runs eagerly");
    return eager(inputs);
  }
  return replay(inputs);
}

void GraphedStep::wait_for_callers() {
  for (size_t k = 0; k < devices_.size(); ++k) {
    ready_[k].record();  // the caller's current stream of devices_[k]
    streams_[0].wait(ready_[k]);
  }
}

void GraphedStep::capture(const std::vector<Tensor>& inputs, std::string* first_error) {
  const Device d = devices_[0];
  DeviceBackend& be = backend(d);
  {
    NoGradGuard no_grad;
    static_inputs_.clear();
    for (const Tensor& t : inputs) {
      // The input's own layout (channels-last stays channels-last): the
      // kernels, and cuDNN's plans, chosen in the warm-up apply as they are.
      Tensor s = ops::clone(t);
      CHORUS_CHECK_T(CaptureError, s.strides() == t.strides(), "an input of shape ", shape_str(t),
                     " has a layout a static buffer cannot copy (a strided view)");
      static_inputs_.push_back(s);
    }
  }
  if (streams_.empty()) {
    for (const Device& dev : devices_) {
      streams_.push_back(Stream::create(dev));
      ready_.emplace_back(dev, false);
    }
    replayed_.emplace(d, false);
  }
  // The capture begins after the caller's work so far (the copies above).
  wait_for_callers();
  std::vector<Tensor> outputs;
  std::vector<std::function<void()>> actions, checks;
  {
    // The step's work on every device goes to the graph's streams, from this
    // thread and from the device threads it fans out to.
    std::vector<std::unique_ptr<StreamGuard>> on_graph_streams;
    for (const Stream& st : streams_) on_graph_streams.push_back(std::make_unique<StreamGuard>(st));
    CaptureScope scope;
    be.capture_begin(d, streams_[0].handle());
    size_t forked = 1;
    struct NoteFirstError {
      std::string* out;
      ~NoteFirstError() { *out = first_capture_error(); }
    } note_first_error{first_error};
    try {
      for (; forked < devices_.size(); ++forked)
        be.capture_fork(devices_[forked], streams_[forked].handle(), d, streams_[0].handle());
      outputs = fn_(static_inputs_);
      for (size_t k = 1; k < devices_.size(); ++k)
        be.capture_join(devices_[k], streams_[k].handle(), d, streams_[0].handle());
    } catch (...) {
      // End the capture whatever it threw (the streams stay unusable otherwise).
      try {
        for (size_t k = 1; k < forked; ++k)
          be.capture_join(devices_[k], streams_[k].handle(), d, streams_[0].handle());
      } catch (const Error&) {
      }
      try {
        // A capture our own check stopped is still valid to CUDA: free it.
        be.graph_destroy(d, be.capture_end(d, streams_[0].handle()));
      } catch (const Error&) {
      }
      throw;
    }
    graph_ = be.capture_end(d, streams_[0].handle());
    actions = scope.take_actions();
    checks = scope.take_checks();
  }
  // Later eager work on the callers' streams (freeing what the capture made)
  // is ordered after the capture streams'.
  replayed_->record(streams_[0]);
  for (const Device& dev : devices_) Stream::current(dev).wait(*replayed_);
  static_outputs_ = std::move(outputs);
  actions_ = std::move(actions);
  checks_ = std::move(checks);
}

std::vector<Tensor> GraphedStep::replay(const std::vector<Tensor>& inputs) {
  const Device d = devices_[0];
  // Before anything is issued: a failed check (an aborted communicator the
  // graph's collectives use) reaches the caller with nothing launched.
  for (const auto& check : checks_) check();
  NoGradGuard no_grad;
  // One multi-tensor copy for the inputs that match their buffers (the batch,
  // its targets, the step's scalars): between two replays each separate copy
  // was a few µs of idle GPU (a CUPTI trace of DataParallel WRN-16-4: four
  // copies, 35 µs of a 2.15 ms step). The rest (another dtype or shape to
  // broadcast) take copy_.
  TensorList srcs, dsts;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].sizes() == static_inputs_[i].sizes() && inputs[i].dtype() == static_inputs_[i].dtype()) {
      srcs.push_back(inputs[i]);
      dsts.push_back(static_inputs_[i]);
    } else {
      ops::copy_(static_inputs_[i], inputs[i]);
    }
  }
  ops::copy_multi(srcs, dsts);
  // The replay reads what the callers' streams wrote (the inputs, a new
  // learning rate on each device); their later work waits for the replay.
  wait_for_callers();
  // Note [Device tracks]: the replayed kernels, NCCL's included, are
  // reported on the stream the graph is launched on.
  if (ops::tracing()) ops::name_trace_stream(d, streams_[0].handle(), "compute stream (CUDA graph)");
  backend(d).graph_replay(d, graph_, streams_[0].handle());
  replayed_->record(streams_[0]);
  for (const Device& dev : devices_) Stream::current(dev).wait(*replayed_);
  ++replays_;
  for (const auto& action : actions_) action();
  std::vector<Tensor> out;
  out.reserve(static_outputs_.size());
  for (const Tensor& t : static_outputs_) out.push_back(t.defined() ? ops::clone(t) : t);
  return out;
}

}  // namespace chorus::parallel
