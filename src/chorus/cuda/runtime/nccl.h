// NCCL in one process: collectives over several GPUs of this machine, issued
// from the calling thread (PyTorch's torch.cuda.comm / torch.cuda.nccl), for
// ops/comm.h. Include only from src/chorus/cuda and src/chorus/ops.
//
// Note [In-process NCCL]: one communicator per device, made together by
// ncclCommInitAll for an ordered device list and cached for the life of the
// process (initialising takes tens of milliseconds; a list is reused every
// step). Rank i of a set is devices[i]; the root of every collective is rank 0.
//
// Ordering. Each call is ordered after the work already issued to the caller's
// current stream of every device it touches, and before the work issued there
// after it returns, as any op is (Note [Current stream] in context.h): the
// collective itself runs on a per-device communication stream that first waits
// (through an event) for the current stream, and the current stream then waits
// for it. The detour is there to avoid a deadlock: the kernels of one
// collective on its N devices are launched one device after the other, and an
// NCCL kernel does not finish until its peers have started. Enqueued directly
// on the current streams, a cross-device copy issued by another thread in
// between (event recorded on device A after A's NCCL kernel, waited for on
// device B before B's) would make B's kernel wait for A's, which waits for B's.
// On the communication streams the collective depends only on work enqueued on
// the current streams before the call, and such an event cannot be.
//
// Memory. The buffers are read and written on the communication streams, but
// every current stream waits for them before the call returns, so a free on a
// current stream (where a buffer was allocated, or named by record_use) is
// ordered after the collective (Note [Freeing across streams] in allocator.h);
// ops/comm.cpp names each caller's current stream with record_use, so the
// allocator's usual rule covers buffers allocated elsewhere too.
//
// Note [Overlapped collectives]: a reduction issued in the middle of a
// backward pass (DataParallel's gradient buckets) must not tie the devices'
// current streams together: with the joins above, device 0's stream would stop
// until every replica had finished all the work already queued on its stream
// (the rest of its backward), and the GPUs would take turns. So
// nccl_reduce_sum_after waits, per rank, for an event its producer recorded
// right after writing the buffer, and the current streams do not wait for it;
// nccl_join(d) later makes the caller's current stream of d wait for every
// collective issued to d so far (one wait at the end of the backward). Memory:
// the caller names the communication stream (nccl_stream) with record_use, so
// a free waits for the collective instead. No deadlock: each rank's collective
// waits only for an event recorded before the call, and the collectives of all
// ranks are enqueued in one order.
//
// Calls are serialised by one process-wide mutex: NCCL requires the
// collectives of a communicator set to be enqueued in the same order on every
// rank, which one group call from one thread at a time guarantees.
//
// Note [NCCL graph mixing]: with NCCL_GRAPH_MIXING_SUPPORT on (NCCL's
// default), a collective issued into a stream capture edits the capturing
// graph directly from the calling thread (an event-record node, then
// cuGraphAddDependencies), so that captured and uncaptured NCCL work may be
// outstanding together. A DataParallel step captures one graph from several
// threads: the thread issuing a bucket's reduction for every device edits the
// graph while the other devices' threads launch their backward kernels into
// it, and CUDA graphs are not safe against that. On 2 H100s `chorus bench
// --strategy dp --device-counts 1,2` (WRN-28-10 bf16) crashed in 4 of 10 runs
// while capturing (SIGSEGV in cuGraphAddDependencies under ncclGroupEnd, or in
// the other thread's cuLaunchKernel), in 0 of 11 with mixing off (benchmarks
// journal, session 16). So before
// the first in-process communicator is made, NCCL_GRAPH_MIXING_SUPPORT is set
// to 0 unless the user set it. What mixing would allow (a graph's NCCL work
// and eager NCCL work in flight at once) never happens here: a capture and a
// replay start after the callers' work on every device (Note [Graphed step]),
// and eager work after a replay waits for it. NCCL reads the variable once
// per process, so a process that made a process-group communicator first
// (distributed/nccl_group.h) keeps what it had then.
#pragma once

#include <cstddef>
#include <vector>

#include "chorus/core/dtype.h"

namespace chorus::cuda {

// Whether this build has NCCL.
bool nccl_available();
// Whether nccl_reduce_sum supports `dtype`.
bool nccl_can_reduce(DType dtype);

// Copies nbytes from bufs[0] (on CUDA device devices[0]) to bufs[i] (on
// devices[i]) for every i >= 1. The devices must be distinct. Throws
// DeviceError naming the NCCL call and NCCL's message.
void nccl_broadcast(const std::vector<int>& devices, const std::vector<void*>& bufs, size_t nbytes);

// dst (on devices[0]) = the elementwise sum of srcs[i] (count elements of
// `dtype` on devices[i]). dst may be srcs[0].
void nccl_reduce_sum(const std::vector<int>& devices, const std::vector<const void*>& srcs, void* dst,
                     size_t count, DType dtype);

// The same sum, ordered by events instead of the current streams (Note
// [Overlapped collectives]): rank i starts once ready[i] (a cudaEvent_t
// recorded on devices[i]) has passed; nothing waits for the result until
// nccl_join.
void nccl_reduce_sum_after(const std::vector<int>& devices, const std::vector<const void*>& srcs, void* dst,
                           size_t count, DType dtype, const std::vector<void*>& ready);
// bufs[i] (count elements of `dtype` on devices[i]) = the elementwise sum of
// all of them, in place, identical on every device; ordered by events as
// nccl_reduce_sum_after (DataParallel's replicated updates).
void nccl_all_reduce_sum_after(const std::vector<int>& devices, const std::vector<void*>& bufs, size_t count,
                               DType dtype, const std::vector<void*>& ready);
// Several all-reduces of nccl_all_reduce_sum_after's kind in one NCCL group
// (Note [Gradients summed where they are] in data_parallel/reducer.h): for each
// tensor t, bufs[t][i] (counts[t] elements of dtypes[t] on devices[i]) = the
// sum over i, in place. One event per device orders them all.
void nccl_all_reduce_each_after(const std::vector<int>& devices, const std::vector<std::vector<void*>>& bufs,
                                const std::vector<size_t>& counts, const std::vector<DType>& dtypes,
                                const std::vector<void*>& ready);
// The calling thread's current stream of `device` waits for every collective
// issued to `device` so far. No-op for a device no collective has used.
void nccl_join(int device);
// The communication stream of `device` (a cudaStream_t), for record_use.
void* nccl_stream(int device);

}  // namespace chorus::cuda
