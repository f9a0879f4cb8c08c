// The table of Note [Environment switches] (env_switches.h).
#include "chorus/core/env_switches.h"

#include <cstdlib>
#include <cstring>

#include "chorus/core/error.h"

namespace chorus::env {

const std::vector<Switch>& switches() {
  static const std::vector<Switch> table = {
      {"CHORUS_CPU_DEVICES", "setting", "logical CPU devices cpu:0..N-1 (default 8)"},
      {"CHORUS_NUM_THREADS", "setting", "threads of one CPU op and of the CPU devices' pool"},
      {"CHORUS_CPU_CACHE_MB", "setting", "host memory the CPU allocator caches (0: no cache)"},
      {"CHORUS_STRICT_PLACEMENT", "setting", "1: a parameter on another device is an error, not a copy"},
      {"CHORUS_DETERMINISTIC", "setting", "1: deterministic cuBLAS and convolution algorithms"},
      {"CHORUS_PEER_ACCESS", "setting", "0: no CUDA peer access between GPUs"},
      {"CHORUS_NCCL_STREAM_PRIORITY", "setting", "high: NCCL's communication stream at the highest priority"},
      {"CHORUS_CONV_SEARCH", "setting", "heuristic: cuDNN's first-ranked plan, no timed search"},
      {"CHORUS_GEMM_SEARCH", "setting", "heuristic: cuBLASLt's first-ranked GEMM algorithm, no timed search"},
      {"CHORUS_ATTENTION_SEARCH", "setting", "heuristic: cuDNN's first fused-attention plan, no timed search"},
      {"CHORUS_CONV_SEARCH_SHARED", "setting", "1: DataParallel replicas share one convolution plan search"},
      {"CHORUS_DP_ALLREDUCE", "setting", "DataParallel's gradient sum (nccl, copy-engine, ...) when the options leave it"},
      {"CHORUS_DP_GRADS", "setting", "DataParallel's gradient form (packed, in-place) when the options leave it"},
      {"CHORUS_DP_GRADS_MIN_BYTES", "setting", "DataParallel: gradients from this size on are summed in place"},
      {"CHORUS_PROFILE", "diagnostic", "1: synchronise around every kernel and print the times"},
      {"CHORUS_PROFILER_RANGE", "diagnostic", "1: chorus bench brackets the timed steps for an external profiler"},
      {"CHORUS_CONV_SEARCH_LOG", "diagnostic", "1: print every cuDNN plan the convolution search times"},
      {"CHORUS_ATTENTION_SEARCH_LOG", "diagnostic", "1: print every cuDNN plan the fused-attention search times"},
      {"CHORUS_CUDNN_LEGACY", "comparison", "1: convolutions through cuDNN's legacy API"},
      {"CHORUS_CONV_ADD_EPILOGUE", "comparison", "0: a residual block's add outside the convolution's epilogue"},
      {"CHORUS_WGRAD_STREAM", "comparison", "0: a convolution's weight gradient on the same stream as its data gradient"},
      {"CHORUS_CONV_GEMM", "comparison", "0: no GEMM path for convolutions of 8 to 32 input channels"},
      {"CHORUS_CONV_DIRECT", "comparison", "0: no direct kernels for convolutions of 1 to 4 input channels"},
      {"CHORUS_CONV_MMA", "comparison", "0: no tensor-core kernel for the forward convolution"},
      {"CHORUS_CUDA_CACHE", "comparison", "0: no per-stream front cache in the CUDA allocator"},
      {"CHORUS_CUDA_PERSISTENT_POOL", "comparison",
       "0: optimizer state and autocast's kept weight copies from the CUDA allocator's common pool"},
      {"CHORUS_GRAPH_MEMSETS", "comparison", "keep: captured graphs keep cuDNN's small memset nodes"},
      {"CHORUS_BENCH_ROW", "internal", "the file a chorus bench DDP worker writes its row to"},
  };
  return table;
}

const char* get(const char* name) {
  for (const Switch& s : switches())
    if (std::strcmp(s.name, name) == 0) return std::getenv(name);
  CHORUS_CHECK(false, "environment switch ", name, " is not in Note [Environment switches]' table (core/env_switches.cpp)");
  return nullptr;
}

}  // namespace chorus::env
