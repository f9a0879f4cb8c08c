// An all-reduce over the GPUs of this process done by their copy engines, for
// DataParallel's replicated updates (ops::copy_engine_all_reduce_sum_after).
// Include only
// from src/chorus/cuda and src/chorus/ops.
//
// Note [Copy-engine all-reduce]: NCCL's all-reduce runs as kernels that hold
// SMs for as long as the transfer lasts; in a DataParallel step it overlaps
// the backward's convolutions, which then run slower (WRN-28-10 bf16 on two
// H100s: the largest part of what the second GPU loses; benchmarks journal,
// session 17). Over
// N GPUs with peer access the same sum needs no SM for the transfer:
//  1. reduce-scatter: device i owns chunk i of the buffer (count / N elements,
//     16-byte aligned); its stream copies chunk i of every other device's
//     buffer into its scratch (cudaMemcpyAsync between devices: a DMA on the
//     copy engines, over NVLink), then one small kernel sums the N chunks in
//     rank order into its own buffer (accumulating in float);
//  2. all-gather: device i's stream copies its summed chunk into chunk i of
//     every other device's buffer.
// Every chunk is summed once, by its owner, and copied bit for bit, so the
// result is identical on every device. Device i's stream starts after every
// ready event (it reads every buffer); a buffer's chunk i is written only by
// device i's stream, after that stream read it, and no other stream touches
// chunk i of any buffer, so nothing else orders the streams. Issued from the
// calling thread, in any order relative to other calls (no kernel waits for a
// peer's: no deadlock is possible). peer_join(d) makes the calling thread's
// current stream of d wait for the copy streams of every device that a call
// with d involved (they all wrote into d's buffer), those of them in the same
// capture as that stream (cuda::same_capture).
//
// Scratch memory is allocated by the caller with each device's copy stream as
// its current stream, after that stream waits for the ready events
// (peer_all_reduce_wait): taken and freed in the copy stream's order, it
// cannot be memory that the backward's kernels still use, and freeing it ties
// no compute stream to the transfer (as a free on the compute stream would,
// Note [Freeing across streams]); inside a capture the copy stream is
// captured by then, so the scratch comes from the graph's pool. Chosen with
// DataParallelOptions::grad_sum = CopyEngine (dist::CopyEngineAllReduce).
#pragma once

#include <cstddef>
#include <vector>

#include "chorus/core/dtype.h"

namespace chorus::cuda {

// Whether peer_all_reduce_sum_after can sum `dtype` over `devices` (every
// pair with peer access; float32, float16 or bfloat16).
bool peer_all_reduce_supported(const std::vector<int>& devices, DType dtype);

// Elements of scratch each device needs for `count` elements over n devices.
size_t peer_all_reduce_scratch(size_t count, size_t n, DType dtype);

// The copy stream of every device in `devices` waits for every ready[i] (a
// cudaEvent_t recorded on devices[i] after its buffer was written).
void peer_all_reduce_wait(const std::vector<int>& devices, const std::vector<void*>& ready);

// Then: bufs[i] (count elements on devices[i]) = the sum of all of them, in
// place; scratch[i]: peer_all_reduce_scratch(...) elements on devices[i],
// allocated on its copy stream.
void peer_all_reduce_sum(const std::vector<int>& devices, const std::vector<void*>& bufs,
                         const std::vector<void*>& scratch, size_t count, DType dtype);

// Note [Gradient sums in the update] (data_parallel/reducer.h), over two devices a
// and b: peer_exchange_wait makes a's copy stream wait for b's ready event and
// b's for a's (each reads only the other's buffers); the caller then
// allocates the destinations on each device's copy stream (after the wait:
// inside a capture the stream is captured by then, and the memory comes from
// the graph's pool), and peer_exchange_copy has a's copy stream copy each
// srcs_b[t] (on b) into dsts_a[t] (on a) and b's each srcs_a[t] into dsts_b[t]:
// DMAs by the copy engines over peer access, no kernel. bytes[t]: the length
// of pair t. peer_join orders later work on either device after both streams.
void peer_exchange_wait(int a, int b, void* ready_a, void* ready_b);
void peer_exchange_copy(int a, int b, const std::vector<void*>& srcs_a, const std::vector<void*>& srcs_b,
                        const std::vector<void*>& dsts_a, const std::vector<void*>& dsts_b,
                        const std::vector<size_t>& bytes);

// The calling thread's current stream of `device` waits for every
// peer_all_reduce_sum_after issued with it so far. No-op if none was.
void peer_join(int device);

// The copy stream of `device` (a cudaStream_t), for record_use.
void* peer_stream(int device);

}  // namespace chorus::cuda
