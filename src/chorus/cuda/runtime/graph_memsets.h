// Small memset nodes of a captured graph rewritten as kernel nodes.
//
// Note [Memset nodes in a graph]: cuDNN's sm90 convolution engines clear a
// 4-byte counter in their workspace before each kernel (cudaMemsetAsync).
// Captured, that is a memset node between two kernel nodes, and a replay pays
// for it far more than the time it runs: the GPU cannot launch the next kernel
// ahead across it, so each one leaves a gap on either side (a CUPTI trace of
// WRN-28-10 bf16 on an H100: one memset before each sm90 convolution kernel,
// and wider gaps with NCCL busy beside it on 2 GPUs; benchmarks journal,
// session 15). Between two kernels, a kernel that writes the same bytes runs
// back to back with its neighbours. So before a captured graph is
// instantiated, every memset node of at most kMaxRewrittenMemsetBytes becomes
// a kernel node on the device that owns its memory, with the same
// dependencies and dependants; larger memsets, and any node joined by an edge
// that is not a plain full dependency (a programmatic launch edge), are left
// as they are. CHORUS_GRAPH_MEMSETS=keep turns the rewrite off (to measure
// it). Where the small kernel is not on the critical path nothing changes; the
// graph's meaning does not (the same bytes, in the same order).
//
// For one session (15) the rewrite was limited to graphs of one device: `chorus
// bench --strategy dp --device-counts 1,2` had crashed while capturing the
// 2-GPU step in three of five runs with it. Session 16 found the crash without
// the rewrite too (4 of 10 runs) and its cause in NCCL's graph mixing (Note
// [NCCL graph mixing] in cuda/runtime/nccl.h); with the rewrite on every graph and
// mixing still on, 0 of 10 — the rewrite only moved the timing.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace chorus::cuda {

inline constexpr size_t kMaxRewrittenMemsetBytes = size_t{1} << 20;

// Rewrites the graph's small memset nodes as kernel nodes (not those of
// child graphs); returns how many. Throws chorus::Error on a CUDA failure.
size_t rewrite_memset_nodes(cudaGraph_t graph);

// Whether captured graphs get the rewrite (not when CHORUS_GRAPH_MEMSETS=keep).
bool rewrite_graph_memsets();

}  // namespace chorus::cuda
