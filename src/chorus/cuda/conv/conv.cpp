// The kernel-set convolutions on CUDA: through cuDNN's graph API with cached
// execution plans (conv_plan.h), or cuDNN 9's legacy API for the geometries
// the graph API has no engine for (and under CHORUS_CUDNN_LEGACY=1).
//
// Note [Convolution layouts]: activations arrive as NCHW-contiguous tensors or
// as channels-last views (NHWC memory, strides {H*W*C, 1, W*C, C} for sizes
// [N,C,H,W]); the strides say which. cuDNN is told the layout, so an NHWC
// bfloat16 network runs on tensor cores with no transposes. The activations of
// one call share one layout; the filter is described in that layout too, and a
// weight stored in the other layout is converted into a temporary first (a
// well-formed program keeps weights in the activations' layout, as PyTorch's
// model.to(memory_format=channels_last) does).
//
// Note [Convolution algorithm search] (legacy path; Note [Plan search] in
// conv_plan.h is the graph path's): as PyTorch with cudnn.benchmark, the
// first call of a geometry (shape, dtype, layout, TF32 switch, alignment) on a
// device times every cuDNN algorithm on the real operands
// (cudnnFind*AlgorithmEx) and caches the fastest; later calls just run it. The
// search blocks the host once per geometry (cuDNN times with events); the runs
// never do. Workspaces come from the stream-ordered allocator, so they are
// reused by the next call on the stream without any synchronisation.
//
// Bias add and bias gradient use the kernel set's broadcasting binary() and
// reduce() (all dtypes, both layouts), not cudnnAddTensor /
// cudnnConvolutionBackwardBias, whose bfloat16 support cuDNN does not document.
#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <vector>

#include "chorus/core/env_switches.h"
#include "chorus/core/error.h"
#include "chorus/cuda/blas/blas.h"
#include "chorus/cuda/runtime/caches.h"
#include "chorus/cuda/runtime/context.h"
#include "chorus/cuda/conv/conv_direct.h"
#include "chorus/cuda/conv/conv_mma.h"
#include "chorus/cuda/conv/conv_gemm.h"
#include "chorus/cuda/conv/conv_plan.h"
#include "chorus/cuda/cudnn/cudnn_handle.h"
#include "chorus/cuda/kernels/kernels.h"
#include "chorus/cuda/runtime/time_calls.h"
#include "chorus/core/graph_capture.h"
#include "chorus/core/stream.h"

CHORUS_CUDNN_LEGACY_BEGIN

namespace chorus::cuda {

namespace {

// Most workspace an algorithm search may use; algorithms needing more are not
// tried.
constexpr size_t kMaxFindWorkspaceBytes = size_t{1} << 30;

using FilterDesc =
    CudnnDescriptor<cudnnFilterDescriptor_t, cudnnCreateFilterDescriptor, cudnnDestroyFilterDescriptor>;
using ConvDesc = CudnnDescriptor<cudnnConvolutionDescriptor_t, cudnnCreateConvolutionDescriptor,
                                 cudnnDestroyConvolutionDescriptor>;

using Direction = ConvDirection;

int checked_int(int64_t v) {
  CHORUS_CHECK(v >= 0 && v <= INT_MAX, "conv2d: size ", v, " exceeds cuDNN's int range");
  return static_cast<int>(v);
}

// Math mode: float32 uses TF32 tensor cores only when allowed (Note [TF32
// defaults] in blas.h); bfloat16/float16 always use tensor cores.
cudnnMathType_t math_type(DType t) {
  if (t == kFloat32) return allow_tf32_conv() ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH;
  return CUDNN_TENSOR_OP_MATH;
}

// The descriptors and device pointers of one convolution, in cuDNN's naming:
// x input, w filter, y output. Backward-data writes x (dx), backward-filter
// writes w (dw), forward writes y.
struct ConvCall {
  ConvCall(Direction dir_, const Conv2dGeometry& g, DType dtype_, Layout layout, int device_,
           void* x_, void* w_, void* y_)
      : dir(dir_),
        dtype(dtype_),
        device(device_),
        handle(cudnn_handle(device_)),
        x_desc(cudnn_dtype(dtype_, "conv2d"), layout, g.n, g.c_in, g.h, g.w),
        y_desc(cudnn_dtype(dtype_, "conv2d"), layout, g.n, g.c_out, g.out_h(), g.out_w()),
        x(x_),
        w(w_),
        y(y_) {
    CHORUS_CUDNN_CHECK(cudnnSetFilter4dDescriptor(
        w_desc.get(), cudnn_dtype(dtype, "conv2d"),
        layout == Layout::NCHW ? CUDNN_TENSOR_NCHW : CUDNN_TENSOR_NHWC, checked_int(g.c_out),
        checked_int(g.c_in / g.groups), checked_int(g.kh), checked_int(g.kw)));
    // Float accumulation for every dtype (cuDNN's "pseudo-half" configuration).
    CHORUS_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(
        conv.get(), checked_int(g.pad_h), checked_int(g.pad_w), checked_int(g.stride_h),
        checked_int(g.stride_w), checked_int(g.dil_h), checked_int(g.dil_w),
        CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
    CHORUS_CUDNN_CHECK(cudnnSetConvolutionGroupCount(conv.get(), checked_int(g.groups)));
    CHORUS_CUDNN_CHECK(cudnnSetConvolutionMathType(conv.get(), math_type(dtype)));
  }

  Direction dir;
  DType dtype;
  int device;
  cudnnHandle_t handle;
  TensorDesc x_desc, y_desc;
  FilterDesc w_desc;
  ConvDesc conv;
  void* x;
  void* w;
  void* y;
};

// One result of an algorithm search, whatever the direction.
struct Perf {
  int algo;
  cudnnStatus_t status;
  size_t memory;
  cudnnMathType_t math;
  cudnnDeterminism_t determinism;
};

template <typename P>
void collect(const P* results, int n, std::vector<Perf>* out) {
  for (int i = 0; i < n; ++i)
    out->push_back({static_cast<int>(results[i].algo), results[i].status, results[i].memory,
                    results[i].mathType, results[i].determinism});
}

int algo_count(Direction dir) {
  switch (dir) {
    case Direction::Forward:
      return CUDNN_CONVOLUTION_FWD_ALGO_COUNT;
    case Direction::BackwardData:
      return CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT;
    case Direction::BackwardFilter:
      return CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT;
  }
  return 0;
}

// Workspace that `algo` needs, or 0 with *ok = false when it does not apply.
size_t workspace_size(const ConvCall& c, int algo, bool* ok) {
  size_t bytes = 0;
  cudnnStatus_t st = CUDNN_STATUS_SUCCESS;
  switch (c.dir) {
    case Direction::Forward:
      st = cudnnGetConvolutionForwardWorkspaceSize(
          c.handle, c.x_desc.get(), c.w_desc.get(), c.conv.get(), c.y_desc.get(),
          static_cast<cudnnConvolutionFwdAlgo_t>(algo), &bytes);
      break;
    case Direction::BackwardData:
      st = cudnnGetConvolutionBackwardDataWorkspaceSize(
          c.handle, c.w_desc.get(), c.y_desc.get(), c.conv.get(), c.x_desc.get(),
          static_cast<cudnnConvolutionBwdDataAlgo_t>(algo), &bytes);
      break;
    case Direction::BackwardFilter:
      st = cudnnGetConvolutionBackwardFilterWorkspaceSize(
          c.handle, c.x_desc.get(), c.y_desc.get(), c.conv.get(), c.w_desc.get(),
          static_cast<cudnnConvolutionBwdFilterAlgo_t>(algo), &bytes);
      break;
  }
  *ok = st == CUDNN_STATUS_SUCCESS;
  return *ok ? bytes : 0;
}

// Times every algorithm on the call's operands (overwriting its output).
std::vector<Perf> find_algorithms(const ConvCall& c, void* ws, size_t ws_bytes) {
  std::vector<Perf> perfs;
  int n = 0;
  switch (c.dir) {
    case Direction::Forward: {
      cudnnConvolutionFwdAlgoPerf_t r[CUDNN_CONVOLUTION_FWD_ALGO_COUNT];
      if (heuristic_plans()) {  // Note [Heuristic plans] in conv_plan.h: ranked, not run
        CHORUS_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(c.handle, c.x_desc.get(), c.w_desc.get(), c.conv.get(),
                                                                  c.y_desc.get(), CUDNN_CONVOLUTION_FWD_ALGO_COUNT, &n, r));
        collect(r, n, &perfs);
        break;
      }
      CHORUS_CUDNN_CHECK(cudnnFindConvolutionForwardAlgorithmEx(
          c.handle, c.x_desc.get(), c.x, c.w_desc.get(), c.w, c.conv.get(), c.y_desc.get(), c.y,
          CUDNN_CONVOLUTION_FWD_ALGO_COUNT, &n, r, ws, ws_bytes));
      collect(r, n, &perfs);
      break;
    }
    case Direction::BackwardData: {
      cudnnConvolutionBwdDataAlgoPerf_t r[CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT];
      if (heuristic_plans()) {
        CHORUS_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(c.handle, c.w_desc.get(), c.y_desc.get(), c.conv.get(),
                                                                       c.x_desc.get(), CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT,
                                                                       &n, r));
        collect(r, n, &perfs);
        break;
      }
      CHORUS_CUDNN_CHECK(cudnnFindConvolutionBackwardDataAlgorithmEx(
          c.handle, c.w_desc.get(), c.w, c.y_desc.get(), c.y, c.conv.get(), c.x_desc.get(), c.x,
          CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT, &n, r, ws, ws_bytes));
      collect(r, n, &perfs);
      break;
    }
    case Direction::BackwardFilter: {
      cudnnConvolutionBwdFilterAlgoPerf_t r[CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT];
      if (heuristic_plans()) {
        CHORUS_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(c.handle, c.x_desc.get(), c.y_desc.get(),
                                                                         c.conv.get(), c.w_desc.get(),
                                                                         CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT, &n, r));
        collect(r, n, &perfs);
        break;
      }
      CHORUS_CUDNN_CHECK(cudnnFindConvolutionBackwardFilterAlgorithmEx(
          c.handle, c.x_desc.get(), c.x, c.y_desc.get(), c.y, c.conv.get(), c.w_desc.get(), c.w,
          CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT, &n, r, ws, ws_bytes));
      collect(r, n, &perfs);
      break;
    }
  }
  return perfs;
}

void run(const ConvCall& c, int algo, void* ws, size_t ws_bytes) {
  // Scaling factors are float for float, half and bfloat16 data.
  const float one = 1.0f, zero = 0.0f;
  switch (c.dir) {
    case Direction::Forward:
      CHORUS_CUDNN_CHECK(cudnnConvolutionForward(
          c.handle, &one, c.x_desc.get(), c.x, c.w_desc.get(), c.w, c.conv.get(),
          static_cast<cudnnConvolutionFwdAlgo_t>(algo), ws, ws_bytes, &zero, c.y_desc.get(), c.y));
      break;
    case Direction::BackwardData:
      CHORUS_CUDNN_CHECK(cudnnConvolutionBackwardData(
          c.handle, &one, c.w_desc.get(), c.w, c.y_desc.get(), c.y, c.conv.get(),
          static_cast<cudnnConvolutionBwdDataAlgo_t>(algo), ws, ws_bytes, &zero, c.x_desc.get(),
          c.x));
      break;
    case Direction::BackwardFilter:
      CHORUS_CUDNN_CHECK(cudnnConvolutionBackwardFilter(
          c.handle, &one, c.x_desc.get(), c.x, c.y_desc.get(), c.y, c.conv.get(),
          static_cast<cudnnConvolutionBwdFilterAlgo_t>(algo), ws, ws_bytes, &zero, c.w_desc.get(),
          c.w));
      break;
  }
}

// ---- the algorithm cache (Note [Convolution algorithm search]) ---------------------------

struct Choice {
  int algo;
  cudnnMathType_t math;
  size_t workspace;
};

using AlgoCache = LockedCache<ConvKey, Choice>;
AlgoCache& algo_cache() {
  static auto* cache = new AlgoCache;  // leaked: used from threads that may outlive statics
  return *cache;
}

ConvKey make_key(const ConvCall& c, const Conv2dGeometry& g, Layout layout) {
  return conv_key(c.dir, g, c.dtype, layout, c.device,
                  static_cast<int64_t>(math_type(c.dtype)) | (deterministic() ? 256 : 0) | (heuristic_plans() ? 512 : 0),
                  ConvOperands{c.x, c.w, c.y});
}

Tensor workspace_tensor(size_t bytes, int device) {
  if (bytes == 0) return Tensor();
  return detail::empty_tensor({static_cast<int64_t>(bytes)}, kUInt8,
                              Device(DeviceType::CUDA, device));
}

Choice search(ConvCall& c, const Conv2dGeometry& g) {
  size_t want = 0;
  for (int a = 0; a < algo_count(c.dir); ++a) {
    bool ok = false;
    const size_t bytes = workspace_size(c, a, &ok);
    if (ok && bytes <= kMaxFindWorkspaceBytes) want = std::max(want, bytes);
  }
  // Search with the most workspace the device can give now; algorithms that
  // need more are skipped by cuDNN. (Heuristic plans run nothing here: no
  // workspace, and the ranked algorithms are held to the same limit below.)
  Tensor ws;
  if (heuristic_plans()) want = 0;
  for (;;) {
    try {
      ws = workspace_tensor(want, c.device);
      break;
    } catch (const OutOfMemoryError&) {
      want = want < (size_t{1} << 20) ? 0 : want / 2;
    }
  }
  const std::vector<Perf> perfs = find_algorithms(c, ws.defined() ? ws.raw_data() : nullptr, want);
  for (const Perf& p : perfs) {  // sorted fastest first
    if (p.status != CUDNN_STATUS_SUCCESS) continue;
    if (heuristic_plans() && p.memory > kMaxFindWorkspaceBytes) continue;
    if (deterministic() && p.determinism == CUDNN_NON_DETERMINISTIC) continue;
    if (c.dtype == kFloat32 && !allow_tf32_conv() &&
        (p.math == CUDNN_TENSOR_OP_MATH || p.math == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION))
      continue;
    // cuDNN may report less memory than the algorithm asks for in its math
    // mode; take the larger of the two.
    CHORUS_CUDNN_CHECK(cudnnSetConvolutionMathType(c.conv.get(), p.math));
    bool ok = false;
    const size_t needed = workspace_size(c, p.algo, &ok);
    return {p.algo, p.math, std::max(p.memory, needed)};
  }
  CHORUS_THROW(DeviceError, "conv2d: cuDNN found no algorithm for ", dtype_name(c.dtype),
               " input [", g.n, ", ", g.c_in, ", ", g.h, ", ", g.w, "], weight [", g.c_out, ", ",
               g.c_in / g.groups, ", ", g.kh, ", ", g.kw, "], stride ", g.stride_h, "x", g.stride_w,
               ", padding ", g.pad_h, "x", g.pad_w, ", dilation ", g.dil_h, "x", g.dil_w,
               ", groups ", g.groups, " (", perfs.size(), " algorithms tried)");
}

// Chooses (searching once per key) and runs the algorithm for `c`.
void execute(ConvCall& c, const Conv2dGeometry& g, Layout layout) {
  const ConvKey key = make_key(c, g, layout);
  const Choice choice = algo_cache().get_or_search(key, [&] { return search(c, g); });
  CHORUS_CUDNN_CHECK(cudnnSetConvolutionMathType(c.conv.get(), choice.math));
  Tensor ws = workspace_tensor(choice.workspace, c.device);
  run(c, choice.algo, ws.defined() ? ws.raw_data() : nullptr, choice.workspace);
}

// Runs one convolution: a graph-API plan when cuDNN has one, else the legacy
// API's searched algorithm.
void run_conv(Direction dir, const Conv2dGeometry& g, DType dtype, Layout layout, int device,
              void* x, void* w, void* y) {
  if (run_conv_graph(dir, g, dtype, layout, device, ConvOperands{x, w, y})) return;
  ConvCall c(dir, g, dtype, layout, device, x, w, y);
  execute(c, g, layout);
}

// ---- layouts and arguments ------------------------------------------------------------------

// The layout of two activations that must share one (Note [Convolution layouts]).
Layout data_layout(const char* op, const Tensor& a, const char* a_name, const Tensor& b,
                   const char* b_name) {
  const Layout l = layout_of(a, layout_of(b, Layout::NCHW, op, b_name), op, a_name);
  CHORUS_CHECK(is_dense_in(b, l), op, ": '", a_name, "' and '", b_name,
               "' must share one memory layout (both contiguous or both channels-last), got ",
               a.describe(), " with strides ", shape_str(a.strides()), " and ", b.describe(),
               " with strides ", shape_str(b.strides()));
  return l;
}

// `weight` itself when it is stored in `layout`, else a copy that is.
Tensor filter_in(const Tensor& weight, Layout layout) {
  if (is_dense_in(weight, layout)) return weight;
  Tensor w = empty_in(layout, weight.sizes(), weight.dtype(), weight.device());
  copy(weight, w);
  return w;
}

// `w_may_be_float`: w may be float32 beside 16-bit x and y (a filter gradient,
// see conv2d_backward_weight).
void check_conv(const char* op, const Conv2dGeometry& g, const Tensor& x, const char* x_name,
                const Tensor& w, const char* w_name, const Tensor& y, const char* y_name,
                bool w_may_be_float = false) {
  CHORUS_CHECK(g.kh > 0 && g.kw > 0 && g.stride_h > 0 && g.stride_w > 0 && g.dil_h > 0 &&
                   g.dil_w > 0 && g.pad_h >= 0 && g.pad_w >= 0 && g.out_h() > 0 && g.out_w() > 0,
               op, ": bad geometry: input ", g.h, "x", g.w, ", kernel ", g.kh, "x", g.kw,
               ", stride ", g.stride_h, "x", g.stride_w, ", padding ", g.pad_h, "x", g.pad_w,
               ", dilation ", g.dil_h, "x", g.dil_w);
  const Shape xs{g.n, g.c_in, g.h, g.w}, ws{g.c_out, g.c_in / g.groups, g.kh, g.kw},
      ys{g.n, g.c_out, g.out_h(), g.out_w()};
  CHORUS_CHECK(g.groups > 0 && g.c_in % g.groups == 0 && g.c_out % g.groups == 0, op, ": channels ",
               g.c_in, " -> ", g.c_out, " not divisible by groups ", g.groups);
  CHORUS_CHECK(x.sizes() == xs && w.sizes() == ws && y.sizes() == ys, op, ": expected ", x_name,
               " ", shape_str(xs), ", ", w_name, " ", shape_str(ws), ", ", y_name, " ",
               shape_str(ys), "; got ", x.describe(), ", ", w.describe(), ", ", y.describe());
  const bool float_w = w_may_be_float && w.dtype() == kFloat32 && (x.dtype() == kBFloat16 || x.dtype() == kFloat16);
  CHORUS_CHECK((x.dtype() == w.dtype() || float_w) && x.dtype() == y.dtype(), op, ": ", x_name, ", ", w_name,
               " and ", y_name, " must share one dtype", w_may_be_float ? " (or a float32 filter gradient of 16-bit data)" : "",
               ", got ", x.describe(), ", ", w.describe(), ", ", y.describe());
  cudnn_dtype(x.dtype(), op);
}

// Note [Convolutions of few input channels as GEMMs] (conv_gemm.h): whether
// this call takes the GEMM path (timed against cuDNN once per geometry).
bool gemm_path_wins(Direction dir, const Conv2dGeometry& g, DType dtype, Layout layout, int device,
                    const ConvOperands& ops, const std::function<void()>& cudnn_run,
                    const std::function<void()>& gemm_run);
// Note [Direct convolutions of a few input channels] (conv_direct.h): the same
// for the direct kernels.
// `tag` tells apart calls whose cuDNN side differs (a weight gradient that
// cuDNN writes to a temporary and converts).
bool direct_path_wins(Direction dir, const Conv2dGeometry& g, DType dtype, Layout layout, int device,
                      const ConvOperands& ops, const std::function<void()>& cudnn_run,
                      const std::function<void()>& direct_run, int64_t tag = 0);
// Note [Tensor-core convolutions of few channels] (conv_mma.h): the same for
// the tensor-core forward kernel.
bool mma_path_wins(Direction dir, const Conv2dGeometry& g, DType dtype, Layout layout, int device,
                   const ConvOperands& ops, const std::function<void()>& cudnn_run,
                   const std::function<void()>& mma_run);

}  // namespace

void conv2d_forward(const Conv2dGeometry& g, const Tensor& x, const Tensor& weight,
                    const Tensor& bias, const Tensor& y) {
  const char* op = "conv2d_forward";
  check_conv(op, g, x, "x", weight, "weight", y, "y");
  if (bias.defined()) {
    CHORUS_CHECK(bias.dim() == 1 && bias.size(0) == g.c_out && bias.dtype() == y.dtype(), op,
                 ": expected bias ", dtype_name(y.dtype()), "[", g.c_out, "], got ",
                 bias.describe());
  }
  const int device = x.device().index;
  CudaDeviceGuard guard(device);
  if (y.numel() == 0) return;
  const Layout layout = data_layout(op, x, "x", y, "y");
  if (x.numel() == 0) {  // no input channels: the sum is empty
    fill(y, 0.0);
  } else {
    const Tensor w = filter_in(weight, layout);
    auto cudnn_run = [&] {
      run_conv(Direction::Forward, g, x.dtype(), layout, device, x.raw_data(), w.raw_data(), y.raw_data());
    };
    auto gemm_run = [&] { conv_gemm_forward(g, x, w, y); };
    auto direct_run = [&] { conv_direct_forward(g, x, w, y); };
    auto mma_run = [&] { conv_mma_forward(g, x, w, y); };
    const ConvOperands ops{x.raw_data(), w.raw_data(), y.raw_data()};
    if (direct_path_wins(Direction::Forward, g, x.dtype(), layout, device, ops, cudnn_run, direct_run))
      direct_run();
    else if (conv_mma_aligned(x, w, y) &&
             mma_path_wins(Direction::Forward, g, x.dtype(), layout, device, ops, cudnn_run, mma_run))
      mma_run();
    else if (gemm_path_wins(Direction::Forward, g, x.dtype(), layout, device, ops, cudnn_run, gemm_run))
      gemm_run();
    else
      cudnn_run();
  }
  if (bias.defined()) {
    // y += bias, broadcast over N, H, W by a stride-0 view.
    const Tensor b =
        detail::make_view(bias, y.sizes(), {0, bias.stride(0), 0, 0}, bias.storage_offset());
    binary(BinaryOp::Add, y, b, y, 1.0);
  }
}

// Note [Residual add in the epilogue]: a residual block ends in y = conv(h) +
// shortcut. As two kernels, the add reads the convolution's output and the
// shortcut and writes y: three passes over an activation. As one cuDNN graph
// (the convolution into a virtual float tensor, then a pointwise add of the
// shortcut), the convolution's epilogue reads the shortcut and writes y once,
// rounding once. What cuDNN runs for that graph is a runtime-fusion kernel, not
// its fastest plain sm90 convolution, so the gain is the add's passes less the
// slower main loop: on an H100 (bf16 NHWC, batch 128, bench_conv_add_gpu) a
// clear gain at WRN-16-4's layers, a tie at WRN-28-10's that went either way
// from run to run (benchmarks journal, session 22). So, as the plan search does for plans,
// each geometry is timed once both ways (fused, and the plain convolution then
// the add over flat views), behind a gate, and runs the faster from then on.
// Untimed (CHORUS_CONV_SEARCH=heuristic, or first met inside a capture, where
// the choice is not kept and the next eager call times it) it takes the fused
// plan. Where no graph plan exists (or with CHORUS_CONV_ADD_EPILOGUE=0, or
// set_conv_add_epilogue(false)) the two kernels run.
namespace {
std::atomic<int64_t> epilogue_runs{0};
std::atomic<int>& epilogue_flag() {
  static std::atomic<int> flag{[] {
    const char* e = chorus::env::get("CHORUS_CONV_ADD_EPILOGUE");
    return e && std::strcmp(e, "0") == 0 ? 0 : 1;
  }()};
  return flag;
}
bool add_in_epilogue() { return epilogue_flag().load(std::memory_order_relaxed) != 0; }
}  // namespace

void set_conv_add_epilogue(bool on) { epilogue_flag().store(on ? 1 : 0, std::memory_order_relaxed); }

int64_t conv_add_epilogue_runs() { return epilogue_runs.load(std::memory_order_relaxed); }

namespace {

// y = conv(x, w), then y += residual over flat views: both are dense in one
// layout, so element i of one is element i of the other in memory (the 4-d
// strided path of a channels-last tensor is several times slower).
void conv_then_add(const Conv2dGeometry& g, const Tensor& x, const Tensor& weight, const Tensor& residual,
                   const Tensor& y) {
  conv2d_forward(g, x, weight, Tensor(), y);
  const Tensor flat_y = detail::make_view(y, {y.numel()}, {1}, y.storage_offset());
  const Tensor flat_r = detail::make_view(residual, {residual.numel()}, {1}, residual.storage_offset());
  binary(BinaryOp::Add, flat_y, flat_r, flat_y, 1.0);
}

// The fused plan is kept only when it is timed at least 3% faster than the
// convolution then the add: inside a whole step it ran slower than timed alone
// (H100, WRN-28-10 bf16, CUPTI trace of graphed steps at 32x32x160), so
// near-ties went the wrong way; WRN-16-4's layers gain by far more and stay
// fused (benchmarks journal, session 22).
constexpr float kFuseMargin = 0.97f;

// Per geometry, direction and path (the key's tag): whether the path beat
// cuDNN's plan.
LockedCache<ConvKey, bool>& path_choices() {
  static auto* cache = new LockedCache<ConvKey, bool>;  // leaked, as fuse_choices()
  return *cache;
}

// Whether the alternative to cuDNN (`name`, told apart in the key by `tag`)
// takes this call: timed once per geometry and direction, kept when 3% ahead.
bool alternative_wins(const char* name, int64_t tag, Direction dir, const Conv2dGeometry& g, DType dtype,
                      Layout layout, int device, const ConvOperands& ops, const std::function<void()>& cudnn_run,
                      const std::function<void()>& alt_run) {
  const ConvKey key = conv_key(dir, g, dtype, layout, device,
                               tag | (deterministic() ? 256 : 0) | (heuristic_plans() ? 512 : 0), ops);
  if (std::optional<bool> c = path_choices().find(key)) return *c;
  // Untimed (heuristic plans, or first met inside a capture: not kept, the
  // next eager call times it): cuDNN's plan, as without the path.
  if (heuristic_plans() || capture_in_progress()) return false;
  const float cudnn_ms = time_calls(device, cudnn_run), alt_ms = time_calls(device, alt_run);
  const bool wins = alt_ms < kFuseMargin * cudnn_ms;
  if (conv_search_log())
    std::fprintf(stderr, "conv %s: %s n%lld c%lld %lldx%lld k%lld r%lld s%lld on cuda:%d: cuDNN %.4f ms, %s %.4f ms: %s\n",
                 name, dir == Direction::Forward ? "forward" : dir == Direction::BackwardData ? "data gradient" : "weight gradient",
                 (long long)g.n, (long long)g.c_in, (long long)g.h, (long long)g.w, (long long)g.c_out,
                 (long long)g.kh, (long long)g.stride_h, device, cudnn_ms, name, alt_ms, wins ? name : "cuDNN");
  path_choices().insert(key, wins);
  return wins;
}

bool gemm_path_wins(Direction dir, const Conv2dGeometry& g, DType dtype, Layout layout, int device,
                    const ConvOperands& ops, const std::function<void()>& cudnn_run,
                    const std::function<void()>& gemm_run) {
  if (!conv_gemm_enabled() || !conv_gemm_applies(g, layout, dtype)) return false;
  return alternative_wins("gemm", 4096, dir, g, dtype, layout, device, ops, cudnn_run, gemm_run);
}

bool mma_path_wins(Direction dir, const Conv2dGeometry& g, DType dtype, Layout layout, int device,
                   const ConvOperands& ops, const std::function<void()>& cudnn_run,
                   const std::function<void()>& mma_run) {
  if (dir != Direction::Forward || !conv_mma_enabled() || !conv_mma_applies(g, layout, dtype)) return false;
  return alternative_wins("mma", 32768, dir, g, dtype, layout, device, ops, cudnn_run, mma_run);
}

bool direct_path_wins(Direction dir, const Conv2dGeometry& g, DType dtype, Layout layout, int device,
                      const ConvOperands& ops, const std::function<void()>& cudnn_run,
                      const std::function<void()>& direct_run, int64_t tag) {
  if (!conv_direct_enabled() || !conv_direct_applies(g, layout, dtype)) return false;
  return alternative_wins("direct", 8192 | tag, dir, g, dtype, layout, device, ops, cudnn_run, direct_run);
}

// Per geometry: whether the fused graph beats the convolution then the add.
LockedCache<ConvKey, bool>& fuse_choices() {
  static auto* cache = new LockedCache<ConvKey, bool>;  // leaked: used from threads that may outlive statics
  return *cache;
}

}  // namespace

void conv2d_forward_add(const Conv2dGeometry& g, const Tensor& x, const Tensor& weight, const Tensor& residual,
                        const Tensor& y) {
  const char* op = "conv2d_forward_add";
  check_conv(op, g, x, "x", weight, "weight", y, "y");
  CHORUS_CHECK(residual.defined() && residual.sizes() == y.sizes() && residual.dtype() == y.dtype() &&
                   residual.device() == y.device(),
               op, ": residual must be ", y.describe(), ", got ", residual.describe());
  const int device = x.device().index;
  CudaDeviceGuard guard(device);
  if (y.numel() == 0) return;
  const Layout layout = data_layout(op, x, "x", y, "y");
  CHORUS_CHECK(is_dense_in(residual, layout), op, ": residual must share y's memory layout, got ",
               residual.describe(), " with strides ", shape_str(residual.strides()));
  const auto* r0 = static_cast<const char*>(residual.raw_data());
  const auto* y0 = static_cast<const char*>(y.raw_data());
  CHORUS_CHECK(r0 >= y0 + y.nbytes() || y0 >= r0 + residual.nbytes(), op, ": residual ", residual.describe(),
               " overlaps the output ", y.describe(), " (the convolution would overwrite it before the add)");
  if (x.numel() > 0 && add_in_epilogue()) {
    const Tensor w = filter_in(weight, layout);
    const ConvOperands ops{x.raw_data(), w.raw_data(), y.raw_data(), residual.raw_data()};
    auto fused = [&] { return run_conv_graph(Direction::Forward, g, x.dtype(), layout, device, ops); };
    const ConvKey key = conv_key(Direction::Forward, g, x.dtype(), layout, device,
                                 static_cast<int64_t>(math_type(x.dtype())) | (deterministic() ? 256 : 0) |
                                     (heuristic_plans() ? 512 : 0) | (allow_tf32_conv() ? 1024 : 0),
                                 ops);
    std::optional<bool> fuse = fuse_choices().find(key);
    if (!fuse && (heuristic_plans() || capture_in_progress())) {
      // Untimed: the fused plan where there is one. A choice met inside a
      // capture is not kept: the next eager call times it.
      if (fused()) {
        if (!capture_in_progress()) fuse_choices().insert(key, true);
        epilogue_runs.fetch_add(1, std::memory_order_relaxed);
        return;
      }
      fuse = false;
      if (!capture_in_progress()) fuse_choices().insert(key, false);
    }
    if (!fuse) {
      bool plan = fused();  // searches the fused graph's plans (y is then written)
      if (plan) {
        const float fused_ms = time_calls(device, fused);
        const float split_ms = time_calls(device, [&] { conv_then_add(g, x, weight, residual, y); });
        plan = fused_ms < kFuseMargin * split_ms;
      }
      fuse = plan;
      fuse_choices().insert(key, plan);
    }
    if (*fuse && fused()) {
      epilogue_runs.fetch_add(1, std::memory_order_relaxed);
      return;
    }
  }
  conv_then_add(g, x, weight, residual, y);
}

// Note [Residual add left to the batch norm] (ops/nn.h): per geometry,
// whether conv(x) + residual is cheaper as the plain convolution with the add
// left to the next batch norm's statistics pass than as conv2d_forward_add.
// Left to the batch norm, the add costs that pass one more read (the
// residual) and a write (the sum): two of the three passes of an add kernel,
// so the estimate is the plain convolution plus 2/3 of a timed add, against
// the fused graph (or, without one, the convolution and the whole add). In
// Wide ResNet-28-10's graphed bf16 step on an H100 the fused graph took much
// longer at 32x32x160 than the plain convolution (CUPTI), while WRN-16-4's
// layers run faster fused and keep it (benchmarks journal, session 24).
namespace {
LockedCache<ConvKey, bool>& defer_choices() {
  static auto* cache = new LockedCache<ConvKey, bool>;  // leaked, as fuse_choices()
  return *cache;
}
constexpr float kDeferredAddShare = 2.0f / 3.0f;
}  // namespace

bool conv2d_add_defers(const Conv2dGeometry& g, const Tensor& x, const Tensor& weight, const Tensor& residual) {
  const char* op = "conv2d_add_defers";
  const int device = x.device().index;
  CudaDeviceGuard guard(device);
  if (x.numel() == 0 || residual.numel() == 0) return true;
  if (!add_in_epilogue()) return true;  // the add is a kernel of its own either way
  const Layout layout = layout_of(x, Layout::NCHW, op, "x");
  if (!is_dense_in(residual, layout)) return true;
  Tensor y = empty_in(layout, residual.sizes(), residual.dtype(), residual.device());
  const Tensor w = filter_in(weight, layout);
  const ConvOperands ops{x.raw_data(), w.raw_data(), y.raw_data(), residual.raw_data()};
  const ConvKey key = conv_key(Direction::Forward, g, x.dtype(), layout, device,
                               static_cast<int64_t>(math_type(x.dtype())) | (deterministic() ? 256 : 0) |
                                   (heuristic_plans() ? 512 : 0) | (allow_tf32_conv() ? 1024 : 0),
                               ops);
  if (std::optional<bool> d = defer_choices().find(key)) return *d;
  // Untimed (heuristic plans, or inside a capture: not kept, the next eager
  // call times it): the fused graph, as conv2d_forward_add takes it untimed.
  if (heuristic_plans() || capture_in_progress()) return false;
  auto fused = [&] { return run_conv_graph(Direction::Forward, g, x.dtype(), layout, device, ops); };
  auto plain = [&] { conv2d_forward(g, x, weight, Tensor(), y); };
  const Tensor flat_y = detail::make_view(y, {y.numel()}, {1}, y.storage_offset());
  const Tensor flat_r = detail::make_view(residual, {residual.numel()}, {1}, residual.storage_offset());
  auto add = [&] { binary(BinaryOp::Add, flat_y, flat_r, flat_y, 1.0); };
  const float conv_ms = time_calls(device, plain), add_ms = time_calls(device, add);
  const float deferred_ms = conv_ms + kDeferredAddShare * add_ms;
  bool defer = true;
  float fused_ms = -1;
  if (fused()) {
    fused_ms = time_calls(device, fused);
    // As conv2d_forward_add keeps the fused graph only 3% ahead (kFuseMargin):
    // in a step it ran slower than alone (H100, WRN-28-10 at 8x8x640;
    // benchmarks journal, session 22).
    defer = kFuseMargin * deferred_ms < fused_ms;
  }
  if (conv_search_log())
    std::fprintf(stderr,
                 "conv add: n%lld c%lld %lldx%lld k%lld r%lld s%lld on cuda:%d: convolution %.4f ms + add %.4f ms, "
                 "fused %.4f ms: %s\n",
                 (long long)g.n, (long long)g.c_in, (long long)g.h, (long long)g.w, (long long)g.c_out,
                 (long long)g.kh, (long long)g.stride_h, device, conv_ms, add_ms, fused_ms,
                 defer ? "the add left to the batch norm" : "fused");
  defer_choices().insert(key, defer);
  return defer;
}

void conv2d_backward_input(const Conv2dGeometry& g, const Tensor& dy, const Tensor& weight,
                           const Tensor& dx) {
  const char* op = "conv2d_backward_input";
  check_conv(op, g, dx, "dx", weight, "weight", dy, "dy");
  const int device = dx.device().index;
  CudaDeviceGuard guard(device);
  if (dx.numel() == 0) return;
  const Layout layout = data_layout(op, dy, "dy", dx, "dx");
  if (dy.numel() == 0) {
    fill(dx, 0.0);
    return;
  }
  const Tensor w = filter_in(weight, layout);
  auto cudnn_run = [&] {
    run_conv(Direction::BackwardData, g, dx.dtype(), layout, device, dx.raw_data(), w.raw_data(), dy.raw_data());
  };
  auto gemm_run = [&] { conv_gemm_backward_input(g, dy, w, dx); };
  if (gemm_path_wins(Direction::BackwardData, g, dx.dtype(), layout, device,
                     ConvOperands{dx.raw_data(), w.raw_data(), dy.raw_data()}, cudnn_run, gemm_run))
    gemm_run();
  else
    cudnn_run();
}

// Note [Float filter gradients from 16-bit data]: under autocast a float32
// parameter's convolution records the parameter itself (autograd::conv2d's
// weight_data), so its filter gradient is asked for in float32 beside 16-bit x
// and dy, and converted here, in the same node, from the 16-bit gradient cuDNN
// writes. cuDNN's graph API does take a float32 dw beside bf16 data, but only
// through a generic runtime-fusion engine, several times slower than its sm90
// wgrad kernels (H100, WRN-28-10; benchmarks journal, session 25), so the 16-bit
// kernel and a conversion it stays. What the float request buys is that the
// whole weight gradient is one node's work, which can run beside the data
// gradient (Note [Weight gradients beside the data gradient] in
// autograd/side_work.h).
void conv2d_backward_weight(const Conv2dGeometry& g, const Tensor& dy, const Tensor& x,
                            const Tensor& dweight, const Tensor& dbias) {
  const char* op = "conv2d_backward_weight";
  const bool float_dw = dweight.dtype() == kFloat32 && (x.dtype() == kBFloat16 || x.dtype() == kFloat16);
  check_conv(op, g, x, "x", dweight, "dweight", dy, "dy", /*w_may_be_float=*/true);
  const int device = x.device().index;
  CudaDeviceGuard guard(device);
  if (dbias.defined()) {
    CHORUS_CHECK(dbias.dim() == 1 && dbias.size(0) == g.c_out && dbias.is_contiguous(), op,
                 ": expected a contiguous dbias [", g.c_out, "], got ", dbias.describe());
  }
  if (dweight.numel() > 0) {
    if (dy.numel() == 0 || x.numel() == 0) {  // empty batch: no contributions
      fill(dweight, 0.0);
    } else {
      const Layout layout = data_layout(op, x, "x", dy, "dy");
      // cuDNN writes the filter gradient in the activations' layout.
      const Tensor dw = is_dense_in(dweight, layout) && !float_dw
                            ? dweight
                            : empty_in(layout, dweight.sizes(), x.dtype(), dweight.device());
      auto cudnn_run = [&] {
        run_conv(Direction::BackwardFilter, g, x.dtype(), layout, device, x.raw_data(), dw.raw_data(),
                 dy.raw_data());
      };
      auto gemm_run = [&] { conv_gemm_backward_weight(g, dy, x, dw); };
      const ConvOperands ops{x.raw_data(), dw.raw_data(), dy.raw_data()};
      // The direct kernels write dweight in its own dtype and strides: timed
      // against cuDNN with its conversion.
      auto direct_run = [&] { conv_direct_backward_weight(g, dy, x, dweight); };
      auto cudnn_and_copy = [&] {
        cudnn_run();
        if (!dw.is_same(dweight)) copy(dw, dweight);
      };
      if (direct_path_wins(Direction::BackwardFilter, g, x.dtype(), layout, device, ops, cudnn_and_copy, direct_run,
                           dw.is_same(dweight) ? 0 : 16384)) {
        direct_run();
      } else {
        if (gemm_path_wins(Direction::BackwardFilter, g, x.dtype(), layout, device, ops, cudnn_run, gemm_run))
          gemm_run();
        else
          cudnn_run();
        if (!dw.is_same(dweight)) copy(dw, dweight);
      }
    }
  }
  if (dbias.defined() && dbias.numel() > 0) {
    if (dy.numel() == 0) {
      fill(dbias, 0.0);
      return;
    }
    // dbias[k] = sum of dy over N, H, W; reduce() writes dy's dtype, contiguous.
    const Tensor db = dbias.dtype() == dy.dtype()
                          ? dbias
                          : detail::empty_tensor({g.c_out}, dy.dtype(), dbias.device());
    const Tensor db4 =
        detail::make_view(db, {1, g.c_out, 1, 1}, {g.c_out, 1, 1, 1}, db.storage_offset());
    reduce(ReduceOp::Sum, dy, db4, {true, false, true, true});
    if (!db.is_same(dbias)) copy(db, dbias);
  }
}

}  // namespace chorus::cuda

CHORUS_CUDNN_LEGACY_END
