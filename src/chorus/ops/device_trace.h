// What the GPUs ran, in a step trace (Note [Step traces] in profile.h).
//
// Note [Device tracks]: when CMake found CUPTI (CHORUS_WITH_CUPTI; `chorus
// --version` says so), start_trace() also turns on CUPTI's activity recording
// (cuda/runtime/cupti_activity.h) and stop_trace() turns it off and adds what the
// devices ran while it was on, as spans on tracks of their own per device:
//  - "cuda:N compute stream": kernels on the stream the traced thread
//    launches its kernels on (the first traced kernel of each device names it);
//  - "cuda:N nccl stream": kernels on the NCCL process group's stream
//    (ncclDevKernel_...; the group names its stream, name_trace_stream);
//  - "cuda:N compute stream (CUDA graph)": a graphed step's replays (their
//    kernels, NCCL's included, are reported on the stream the graph is
//    launched on; parallel::GraphedStep names it);
//  - "cuda:N stream K": any other stream (CUPTI's id);
//  - "cuda:N copies": copies and memsets, whatever their stream.
// Categories: "gpu_kernel", "gpu_comm" (NCCL's kernels), "gpu_copy".
// CUPTI stamps records with its own clock: the offset to the trace's clock
// (the host spans') is measured once when recording starts, as the middle of
// the tightest of a few bracketing reads. A stop that waits (the end of the
// chosen steps) first synchronises the devices the trace saw kernels on, so
// the last step's kernels are all in; a stop that does not (a run ending by an
// error) takes what has completed. Without CUPTI the calls do nothing.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "chorus/core/device.h"
#include "chorus/ops/profile.h"

namespace chorus::ops {

// Whether this build records device activity (CUPTI found at build time).
bool device_trace_built();

// Names `stream` (a cudaStream_t) of `device` in traces: its kernels go on
// the track "<device> <name>" ("cuda:0 nccl stream").
void name_trace_stream(const Device& device, void* stream, const std::string& name);

// The calls of start_trace / ProfileScope / stop_trace (profile.cpp), not
// for other callers. `trace_now_us`: the trace's clock now.
void start_device_trace(const std::function<double()>& trace_now_us);
// A traced kernel is launched on `device` (cheap after the first of each device).
void device_trace_saw(const Device& device);
std::vector<TraceSpan> stop_device_trace(bool wait_for_devices);

}  // namespace chorus::ops
