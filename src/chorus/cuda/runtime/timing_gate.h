// A gate that holds a stream while the host issues work to be timed.
//
// Note [Timing behind a gate]: timing a cuDNN plan with events around runs
// issued back to back measures the GPU only while the host issues runs faster
// than the GPU finishes them. Hopper's sm90 engines cost more host time per
// cudnnBackendExecute than many of their kernels take (the profile of an eager
// step has cuDNN's execute at a quarter of the host's time), so events timed
// the host instead, and the plan search chose slower kernels: in WRN-28-10 a
// cutlass kernel for the 32x32x160 forward convolution where PyTorch runs a
// faster sm90 one (benchmarks journal, session 12). Behind a gate the stream first runs
// a kernel that spins on a flag in host-mapped memory; the host issues the
// timed runs and the stop event, then opens the gate, and the runs execute
// back to back, so the events measure only the GPU (nvbench's blocking
// kernel). The spin gives up after a bound, so a host that never opens the
// gate cannot hold the device; expired() then says the timing includes the
// host. A kernel's first launch may load its module, which waits for the
// kernels running (the spinning gate among them) until the bound: run what is
// to be timed once before closing a gate (time_plan's untimed run does).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace chorus::cuda {

class StreamGate {
 public:
  // Enqueues the spinning kernel on `stream` (of `device`, the current one).
  explicit StreamGate(cudaStream_t stream);
  // Opens the gate if open() was not called (never leaves a stream held).
  ~StreamGate();
  StreamGate(const StreamGate&) = delete;
  StreamGate& operator=(const StreamGate&) = delete;

  // Lets the stream run what was issued after the gate.
  void open();
  // After the stream reached the work behind the gate: whether the spin gave up
  // before open() (the timing then includes the host's issue time).
  bool expired() const;

 private:
  uint32_t generation_;
  bool opened_ = false;
};

}  // namespace chorus::cuda
