// Small memset nodes of a captured graph rewritten as kernel nodes.
//
// Note [Memset nodes in a graph]: cuDNN's sm90 convolution engines clear a
// 4-byte counter in their workspace before each kernel (cudaMemsetAsync).
// Captured, that is a memset node between two kernel nodes, and a replay pays
// for it far more than the 1 µs it runs: the GPU cannot launch the next kernel
// ahead across it, so each one costs a 2.5-5 µs gap on either side (a CUPTI
// trace of WRN-28-10 bf16 on an H100: 54 memsets a step, ~0.35 ms of an
// 11.5 ms step idle; with NCCL busy beside it on 2 GPUs the gaps grow to
// 8-20 µs). Between two kernels, a kernel that writes the same bytes runs
// back to back with its neighbours. So before a captured graph is
// instantiated, every memset node of at most kMaxRewrittenMemsetBytes becomes
// a kernel node on the device that owns its memory, with the same
// dependencies and dependants; larger memsets, and any node joined by an edge
// that is not a plain full dependency (a programmatic launch edge), are left
// as they are. CHORUS_GRAPH_MEMSETS=keep turns the rewrite off (to measure
// it). Only graphs of one device are rewritten (one GPU, DDP's one device per
// process), as measured most: `chorus bench --strategy dp --device-counts 1,2`
// (WRN-28-10) crashed in three of five runs with the rewrite on every graph
// (SIGSEGV in ncclGroupEnd -> cuGraphAddDependencies while capturing the
// 2-GPU step, after the 1-GPU graph) and in none of three without it. The
// cause is not understood (the crash comes before the 2-GPU graph is
// rewritten), so DataParallel's graphs over several GPUs, which gained least
// (0.81 -> 0.83 scaling), keep their memsets until it is; with that, three
// more runs passed. A likely culprit, from NCCL's source: with graph mixing
// on (NCCL_GRAPH_MIXING_SUPPORT, default), each captured collective adds an
// event-record node and its edges straight into the capturing graph
// (cudaGraphAddEventRecordNode, cudaGraphAddDependencies) from the calling
// thread, while DataParallel's other device threads are capturing into the
// same graph: graph objects are not safe against concurrent mutation. Where the 1 µs kernel is not on the critical path nothing changes; the
// graph's meaning does not (the same bytes, in the same order).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace chorus::cuda {

inline constexpr size_t kMaxRewrittenMemsetBytes = size_t{1} << 20;

// Rewrites the graph's small memset nodes as kernel nodes (not those of
// child graphs); returns how many. Throws chorus::Error on a CUDA failure.
size_t rewrite_memset_nodes(cudaGraph_t graph);

// Whether CHORUS_GRAPH_MEMSETS asks to keep the memset nodes.
bool keep_graph_memsets();

}  // namespace chorus::cuda
