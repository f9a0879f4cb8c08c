// Note [Timed GEMM algorithm search] (gemm_search.h).
#include "chorus/cuda/blas/gemm_search.h"

#include <atomic>
#include <cstring>

#include "chorus/core/env_switches.h"
#include "chorus/core/error.h"
#include "chorus/core/graph_capture.h"
#include "chorus/cuda/blas/blas.h"
#include "chorus/cuda/blas/cublaslt_api.h"
#include "chorus/cuda/runtime/search_switch.h"
#include "chorus/cuda/runtime/time_calls.h"

namespace chorus::cuda {

namespace {
SearchSwitch search_switch("CHORUS_GEMM_SEARCH");
std::atomic<int64_t> searches_run{0};
}  // namespace

// Deterministic runs take the heuristic's choice too: timed choices between
// near ties can differ from one process to the next.
bool heuristic_gemm_algos() { return search_switch.heuristic() || deterministic(); }

void set_heuristic_gemm_algos(bool on) { search_switch.set_heuristic(on); }

bool gemm_search_allowed(double beta) { return beta == 0.0 && !heuristic_gemm_algos() && !capture_in_progress(); }

cublasStatus_t MatmulCall::run(const cublasLtMatmulAlgo_t& algo) const {
  return lt::Matmul(handle, desc, &alpha, a, a_layout, b, b_layout, &beta, out, out_layout, out, out_layout, &algo,
                    workspace, kCublasWorkspaceBytes, stream);
}

cublasStatus_t MatmulCall::candidates(cublasLtMatmulPreference_t pref, int requested,
                                      cublasLtMatmulHeuristicResult_t* results, int* found) const {
  *found = 0;
  return lt::MatmulAlgoGetHeuristic(handle, desc, a_layout, b_layout, out_layout, out_layout, pref,
                                    requested < kMaxGemmCandidates ? requested : kMaxGemmCandidates, results, found);
}

std::optional<cublasLtMatmulAlgo_t> fastest_algo(const MatmulCall& call, const cublasLtMatmulHeuristicResult_t* results,
                                                 int found) {
  searches_run.fetch_add(1, std::memory_order_relaxed);
  std::optional<cublasLtMatmulAlgo_t> best;
  float best_ms = 0;
  for (int i = 0; i < found; ++i) {
    const cublasLtMatmulHeuristicResult_t& r = results[i];
    if (r.state != CUBLAS_STATUS_SUCCESS || r.workspaceSize > kCublasWorkspaceBytes) continue;
    const float ms = time_calls(
        call.device,
        [&] {
          if (call.run(r.algo) == CUBLAS_STATUS_SUCCESS) return true;
          (void)cudaGetLastError();  // a refused launch must not poison later error checks
          return false;
        },
        kGemmTimedRuns);
    if (ms >= 0 && (!best || ms < best_ms)) {
      best = r.algo;
      best_ms = ms;
    }
  }
  return best;
}

int64_t gemm_searches_run() { return searches_run.load(std::memory_order_relaxed); }

}  // namespace chorus::cuda
