// Choosing cuBLASLt's algorithm for a GEMM problem by timing the heuristic's
// candidates (Note [Timed GEMM algorithm search]). Include only from
// src/chorus/cuda.
//
// Note [Timed GEMM algorithm search]: cuBLASLt's heuristic ranks algorithms by
// a model of the GPU, not by running them, so its first choice need not be the
// fastest on the GPU at hand (as with cuDNN's plans: Note [Plan search] in
// conv/conv_plan.h; the gain per model is not measured yet). So the first eager
// call of a problem (gemm.cpp's key: shapes, strides, dtypes, alignment,
// epilogue, TF32) asks the heuristic for up to kMaxGemmCandidates algorithms,
// runs each on the call's own operands and epilogue (one untimed run, then
// kGemmTimedRuns behind a gate: cuda/runtime/time_calls.h) and keeps the fastest.
// Candidates that need more than kCublasWorkspaceBytes or that fail to run are
// skipped; when none runs, the heuristic's first stays. The search blocks the
// host once per problem; later calls find the choice in gemm.cpp's cache.
// It runs only where running the product again is harmless and possible:
//  - beta == 0: the product overwrites out (and the epilogue's outputs, the
//    bias gradient or GELU's input); with beta != 0 each run would add to out
//    again, so such a call takes the heuristic's first algorithm, untimed;
//  - no CUDA graph capture in progress (Note [CUDA graphs]): timing waits on
//    the host, which a capture forbids; the capture takes the heuristic's
//    first algorithm.
// Those untimed choices are cached as untimed: the problem's next call that
// may search (an eager one with beta == 0) searches and replaces it, so a
// shape first met with beta != 0 (a gradient accumulated into) or in a capture
// is still timed later. Training runs eager warm-up steps before capturing
// (parallel/graphed_step.h), so the captured graph records searched choices;
// a graph captured from an untimed choice keeps it for its life.
// CHORUS_GEMM_SEARCH=heuristic (or set_heuristic_gemm_algos(true)) takes the
// heuristic's first algorithm everywhere, untimed, as before the search
// (cuBLASLt's choice alone; cheaper under compute-sanitizer), and so does
// CHORUS_DETERMINISTIC=1 (cuda::set_deterministic): timed choices between near
// ties can differ from one process to the next, and with them the rounding.
// Choices of the two modes are cached apart.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <optional>

namespace chorus::cuda {

// Most algorithms asked of the heuristic and timed per problem (32 were no
// faster than 8 for gpt2 on an H200: 554,173 against 559,206 and 556,498
// tok/s in one call, benchmarks journal, session 41).
inline constexpr int kMaxGemmCandidates = 8;
// Timed runs of each candidate: with 3, two processes chose different kernels
// for the same gpt2 products (the traces of sessions 40 and 41 on one H200:
// 16.80 against 16.98 ms of products a step), so each candidate is timed over
// more runs. Whether 10 make the choice stable is not measured yet.
inline constexpr int kGemmTimedRuns = 10;

// CHORUS_GEMM_SEARCH=heuristic (read from the environment once; "timed" or
// unset: the search) or deterministic mode; the setter (tests) overrides the
// environment.
bool heuristic_gemm_algos();
void set_heuristic_gemm_algos(bool on);

// Whether a call with this beta may be timed now: the search is on, beta is 0
// and no capture is in progress.
bool gemm_search_allowed(double beta);

// One cublasLtMatmul call, everything but its algorithm (out = C = D).
struct MatmulCall {
  cublasLtHandle_t handle;
  cublasLtMatmulDesc_t desc;
  const void* a;
  cublasLtMatrixLayout_t a_layout;
  const void* b;
  cublasLtMatrixLayout_t b_layout;
  void* out;
  cublasLtMatrixLayout_t out_layout;
  float alpha;
  float beta;
  void* workspace;  // kCublasWorkspaceBytes
  cudaStream_t stream;
  int device;

  // Runs the product with `algo` on `stream`.
  cublasStatus_t run(const cublasLtMatmulAlgo_t& algo) const;
  // The heuristic's best `requested` algorithms (at most kMaxGemmCandidates)
  // under `pref` into `results`; `found` of them. Returns the heuristic's status.
  cublasStatus_t candidates(cublasLtMatmulPreference_t pref, int requested, cublasLtMatmulHeuristicResult_t* results,
                            int* found) const;
};

// The fastest of `results[0..found)` on `call` (which runs several times:
// only for gemm_search_allowed calls), or nullopt when none runs. Each call
// counts as one search in gemm_searches_run().
std::optional<cublasLtMatmulAlgo_t> fastest_algo(const MatmulCall& call, const cublasLtMatmulHeuristicResult_t* results,
                                                 int found);

// Searches run in this process (tests: which calls time and which reuse).
int64_t gemm_searches_run();

}  // namespace chorus::cuda
