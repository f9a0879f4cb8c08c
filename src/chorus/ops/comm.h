// Collectives over the devices of this process, on flat buffers (one per
// device): what parallel::DataParallel moves its parameters and gradients
// with, one call per buffer instead of one copy per tensor.
//
// On CUDA devices of a build with NCCL both run as one NCCL collective over all
// the devices (Note [In-process NCCL] in cuda/runtime/nccl.h), issued from the calling
// thread. Elsewhere (CPU devices, a mix, a build without NCCL, a dtype NCCL
// cannot add) they fall back to ops::copy_ and in-place adds; the results are
// the same. Like every op, each call is ordered after the work already issued
// to the current stream of every device it touches and before the work issued
// there later; it returns without waiting for the devices.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "chorus/core/stream.h"
#include "chorus/core/tensor.h"

namespace chorus::ops {

// dsts[i] = src for every i. src and each dst: contiguous, the same sizes and
// dtype, on distinct devices (a dst on src's device is not allowed).
void broadcast_coalesced(const Tensor& src, const std::vector<Tensor>& dsts);

// dst = srcs[0] + srcs[1] + ..., in that order where the order is up to
// Chorus (NCCL chooses its own). srcs: contiguous, the same sizes and dtype, on
// distinct devices; dst: the same sizes and dtype, contiguous, on srcs[0]'s
// device (it may be srcs[0] itself).
void reduce_sum(const std::vector<Tensor>& srcs, const Tensor& dst);

// reduce_sum for a sum issued amid other work (DataParallel's gradient
// buckets; Note [Overlapped collectives] in cuda/runtime/nccl.h): srcs[i] is read once
// ready[i] (an Event on srcs[i]'s device, recorded after srcs[i] was written)
// has passed, rather than after all the work on the current streams, and no
// current stream waits for the sum: call comm_join(dst.device()) before work
// on that device's current stream reads dst. The buffers stay allocated until
// the sum has read and written them. Where the fallback runs (not all on CUDA,
// no NCCL), this is reduce_sum.
void reduce_sum_after(const std::vector<Tensor>& srcs, const Tensor& dst, const std::vector<Event>& ready);

// Every bufs[i] = bufs[0] + bufs[1] + ..., in place and identical on every
// device (DataParallel's replicated updates: each replica steps its own copy
// of the weights with the same gradient). Ordered like reduce_sum_after (the
// events, then comm_join on each device before reading); bufs: contiguous,
// the same sizes and dtype, on distinct devices. The fallback sums in order
// into bufs[0] and copies the sum to the others.
void all_reduce_sum_after(const std::vector<Tensor>& bufs, const std::vector<Event>& ready);

// all_reduce_sum_after over several tensors at once (DataParallel's gradients
// summed where the backward wrote them, Note [Gradients summed where they
// are] in data_parallel/reducer.h): for every t, each bufs[t][i] = bufs[t][0] +
// bufs[t][1] + ..., in place; on GPUs one NCCL group for them all. bufs[t]:
// the same sizes, strides and dtype, dense (any memory format: channels-last
// weights' gradients too), bufs[t][i] on the i-th device of one list of
// distinct devices shared by every t; ready[i]: the event of the i-th device.
// Always NCCL or the fallback, never the copy engines (which sum flat buffers).
void all_reduce_sum_each_after(const std::vector<std::vector<Tensor>>& bufs, const std::vector<Event>& ready);

// all_reduce_sum_after by the GPUs' copy engines (Note [Copy-engine
// all-reduce] in cuda/kernels/peer_all_reduce.h): true when they took it (every
// buffer on a GPU, peer access between every pair, a dtype they sum); false,
// with nothing issued, where they do not apply, and the caller sums another
// way (dist::CopyEngineAllReduce falls back to all_reduce_sum_after). Checks
// its arguments as all_reduce_sum_after does.
bool copy_engine_all_reduce_sum_after(const std::vector<Tensor>& bufs, const std::vector<Event>& ready);
// How many all_reduce sums the copy engines have taken so far in this
// process (to tell afterwards whether a run used them).
uint64_t copy_engine_all_reduce_calls();

// Whether exchange_each_after can take gradients over `devices`: exactly two
// distinct devices, both CPU (a plain copy: tests), or both CUDA with peer
// access both ways (which this enables).
bool exchange_possible(const std::vector<Device>& devices);

// Note [Gradient sums in the update] (data_parallel/reducer.h): over exactly two
// devices, parts[t][i] is a copy of the other device's bufs[t][1 - i], on
// bufs[t][i]'s device with its sizes and strides, so bufs[t][i] + parts[t][i]
// is the sum on either device (one float addition: the same bits on both).
// bufs as for all_reduce_sum_each_after. On GPUs each device's copy stream
// copies once the other device's ready event has passed (DMAs by the copy
// engines, no kernel, no SM held); call comm_join on both devices before
// reading a part or writing a buffer. On CPU devices, ops::copy_.
std::vector<std::vector<Tensor>> exchange_each_after(const std::vector<std::vector<Tensor>>& bufs,
                                                     const std::vector<Event>& ready);
// How many exchange_each_after calls this process has made.
uint64_t exchange_calls();

// The current stream of `device` waits for every reduce_sum_after and
// all_reduce_sum_after issued to it so far. No-op where there is nothing to
// wait for.
void comm_join(const Device& device);

}  // namespace chorus::ops
