// Convolutions through cuDNN 9's graph (backend) API, with execution plans
// chosen by timing and cached per geometry.
//
// Note [Why the graph API]: cuDNN 9's legacy entry points
// (cudnnConvolutionForward & co.) reach only the engines behind the old
// algorithm enums. On Hopper the fastest channels-last bfloat16 kernels (the
// sm90 implicit-GEMM engines PyTorch runs through cudnn-frontend) are reachable
// only through engine configurations of an operation graph. So every
// convolution first tries a plan from here; conv.cpp falls back to the legacy
// path only when no engine supports a geometry. CHORUS_CUDNN_LEGACY=1 in the
// environment forces the legacy path (for comparisons).
//
// Note [Plan search]: the first call of a geometry (direction, device, dtype,
// layout, TF32 switch, pointer alignment, shapes) asks cuDNN's heuristics
// (mode A, then the fallback list) for engine configurations, finalises up to
// kMaxCandidates plans that fit the workspace limit and the numerics allowed
// (no TF32 for float32 when it is off; never engines that down-convert float32
// inputs), times each on the real operands and keeps the fastest, as PyTorch's
// cudnn.benchmark does. The search blocks the host once per geometry; later
// calls only build a variant pack and execute (CHORUS_CONV_SEARCH=heuristic:
// cuDNN's first plan, untimed). Plans are shared by the
// threads of a device (each executes with its own handle).
// CHORUS_CONV_SEARCH_LOG=1 prints each plan timed and the one kept. Devices
// of one kind may share the choice (Note [One plan choice per kind of GPU]).
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "chorus/core/dtype.h"
#include "chorus/core/op_kinds.h"
#include "chorus/cuda/cudnn/cudnn_handle.h"

namespace chorus::cuda {

enum class ConvDirection : int { Forward, BackwardData, BackwardFilter };

// The operands of one convolution in cuDNN's naming: x input, w filter, y
// output (backward-data writes x, backward-filter writes w, forward writes y).
struct ConvOperands {
  void* x;
  void* w;
  void* y;
  // Forward only: a tensor shaped like y added in the convolution's epilogue
  // (y = conv(x, w) + r; Note [Residual add in the epilogue]), or null.
  void* r = nullptr;
  // Forward only, probe_conv_genstats: float [C] per-channel sum and sum of
  // squares of y generated in the epilogue, or null.
  float* sum = nullptr;
  float* sqsum = nullptr;
};

// The identity of a convolution for the plan cache here and the legacy
// algorithm cache in conv.cpp: direction, device, dtype, layout, the numerics
// switch that changes the candidates (TF32 / math mode), the operands' common
// alignment, and the geometry.
using ConvKey = IntKey<20>;
ConvKey conv_key(ConvDirection dir, const Conv2dGeometry& g, DType dtype, Layout layout,
                 int device, int64_t numerics, const ConvOperands& ops);

// Alignment (up to 16 bytes) shared by the three operands: the fastest kernels
// need 16-byte aligned rows, so a choice made on aligned pointers does not
// carry over to a misaligned view.
int64_t common_alignment(const ConvOperands& ops);

// Note [Heuristic plans] (conv_plan.cpp): CHORUS_CONV_SEARCH=heuristic takes
// cuDNN's first-ranked plan or algorithm per geometry without timing any
// (PyTorch's cudnn.benchmark = False); "timed" or unset: the search above.
// set_heuristic_plans overrides the environment (plans of both kinds are
// cached apart).
bool heuristic_plans();
void set_heuristic_plans(bool on);

// Note [One plan choice per kind of GPU] (conv_plan.cpp): with
// CHORUS_CONV_SEARCH_SHARED=1 (or set_shared_plan_choices(true)), GPUs of one
// kind run the plan the first of them chose; off by default (every GPU
// searches). Counts since the start: geometries searched (timed, or taken
// from the heuristics), and plans rebuilt from another device's choice.
bool shared_plan_choices();
void set_shared_plan_choices(bool on);
struct ConvSearchCounts {
  int64_t searched = 0, reused = 0;
};
ConvSearchCounts conv_search_counts();

// CHORUS_CONV_SEARCH_LOG set (not 0): the searches print what they time.
bool conv_search_log();

// Whether the graph path is enabled (CHORUS_CUDNN_LEGACY unset or 0).
bool conv_graph_enabled();

// Forward convolutions run with the residual add in cuDNN's epilogue (Note
// [Residual add in the epilogue] in cuda/conv/conv.cpp), since the process began.
int64_t conv_add_epilogue_runs();
// Whether conv2d_forward_add may use the fused graph (default: unless
// CHORUS_CONV_ADD_EPILOGUE=0); tests turn it off to check the split path.
void set_conv_add_epilogue(bool on);

// Runs the convolution on the current stream of `device` with a cached plan
// (searching on first use). Returns false, having done nothing, when cuDNN
// offers no plan for this geometry; throws DeviceError on execution failures.
bool run_conv_graph(ConvDirection dir, const Conv2dGeometry& g, DType dtype, Layout layout,
                    int device, const ConvOperands& ops);

// Issue 14's probe of batch-norm statistics in the convolution's epilogue
// (bench/conv_genstats_gpu.cpp): the forward convolution as a cuDNN graph with
// a GEN_STATS node (SUM_SQSUM of y into ops.sum, ops.sqsum), every engine
// configuration cuDNN's heuristics offer (mode A, then the fallback list)
// finalised and timed on these operands as the plan search times plans. Not
// used by the library: it measures whether the runtime-fusion engines that
// run such graphs beat the plain convolution plus Chorus's statistics pass.
struct GenStatsProbe {
  int configs = 0;      // engine configurations offered
  int plans = 0;        // of those, plans that ran
  float best_ms = -1;   // the fastest plan's milliseconds per call (-1: none ran)
  std::string engine;   // its engine and knobs
  std::string error;    // why the graph was refused, if it was
};
GenStatsProbe probe_conv_genstats(const Conv2dGeometry& g, DType dtype, Layout layout, int device,
                                  const ConvOperands& ops);

}  // namespace chorus::cuda
