// cuDNN graph-API convolutions (Note [Why the graph API], Note [Plan search]
// in conv_plan.h).
#include "chorus/core/env_switches.h"
#include "chorus/cuda/conv/conv_plan.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "chorus/core/error.h"
#include "chorus/cuda/blas/blas.h"
#include "chorus/core/stream.h"
#include "chorus/cuda/runtime/caches.h"
#include "chorus/cuda/runtime/context.h"
#include "chorus/cuda/runtime/search_switch.h"
#include "chorus/cuda/cudnn/cudnn_backend.h"
#include "chorus/cuda/kernels/kernels.h"
#include "chorus/cuda/runtime/timing_gate.h"

// The plan and graph descriptors take the handle through attributes cuDNN 9.19
// marks deprecated (in favour of device properties that older 9.x releases do
// not have); they work in every cuDNN 9.
CHORUS_CUDNN_LEGACY_BEGIN

namespace chorus::cuda {

namespace {

// A switch of the search read from the environment on first use, which a
// setter (tests) overrides: -1 until read.
bool read_switch(std::atomic<int>& state, bool (*from_env)()) {
  int v = state.load(std::memory_order_relaxed);
  if (v >= 0) return v == 1;
  int expected = -1;
  state.compare_exchange_strong(expected, from_env() ? 1 : 0);  // a setter meanwhile wins
  return state.load(std::memory_order_relaxed) == 1;
}

SearchSwitch search_switch("CHORUS_CONV_SEARCH");
std::atomic<int> shared_state{-1};

}  // namespace

// Note [Heuristic plans]: CHORUS_CONV_SEARCH=heuristic takes, per geometry,
// the first plan of cuDNN's heuristics that finalises within the limits, as
// PyTorch does with cudnn.benchmark off: no candidate is run to time it. For
// a faster start where the timed choice does not matter (short jobs, many
// shapes) and for tools that make every kernel run slow (compute-sanitizer:
// the search runs up to kMaxCandidates kernels per geometry, each under its
// instrumentation). "timed" (the default) searches.
bool heuristic_plans() { return search_switch.heuristic(); }

void set_heuristic_plans(bool on) { search_switch.set_heuristic(on); }

// Note [One plan choice per kind of GPU], below.
bool shared_plan_choices() {
  return read_switch(shared_state, [] {
    const char* e = chorus::env::get("CHORUS_CONV_SEARCH_SHARED");
    return e && *e && std::strcmp(e, "0") != 0;
  });
}

void set_shared_plan_choices(bool on) { shared_state.store(on ? 1 : 0); }

namespace {

// Largest workspace a plan may use.
constexpr int64_t kMaxWorkspaceBytes = int64_t{1} << 30;
// Plans timed per geometry (a bound on the one-off search; cuDNN's lists for
// these convolutions are usually shorter).
constexpr size_t kMaxCandidates = 32;
// Timed runs per candidate (after one untimed run that loads its kernels).
constexpr int kTimedRuns = 3;

constexpr int64_t kUidX = 1, kUidW = 2, kUidY = 3, kUidR = 4, kUidConvOut = 5, kUidSum = 6, kUidSqSum = 7;

// A packed 4-d tensor: dims are always [N,C,H,W] (filters [K,C/g,R,S]), the
// strides carry the layout.
BackendDesc tensor_desc(int64_t uid, cudnnDataType_t dtype, Layout layout,
                        const std::array<int64_t, 4>& dims, int64_t alignment, bool is_virtual = false) {
  const int64_t n = dims[0], c = dims[1], h = dims[2], w = dims[3];
  (void)n;
  const std::array<int64_t, 4> strides =
      layout == Layout::NCHW ? std::array<int64_t, 4>{c * h * w, h * w, w, 1}
                             : std::array<int64_t, 4>{c * h * w, 1, w * c, c};
  BackendDesc t(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  t.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dtype);
  t.set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data());
  t.set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data());
  t.set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
  t.set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment);
  if (is_virtual) t.set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual);
  t.finalize();
  return t;
}

BackendDesc conv_desc(const Conv2dGeometry& g) {
  BackendDesc c(CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR);
  const cudnnDataType_t comp = CUDNN_DATA_FLOAT;  // float accumulation for every dtype
  const cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
  const int64_t dims = 2;
  const int64_t dil[2] = {g.dil_h, g.dil_w}, stride[2] = {g.stride_h, g.stride_w},
                pad[2] = {g.pad_h, g.pad_w};
  c.set(CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp);
  c.set(CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, 1, &mode);
  c.set(CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, CUDNN_TYPE_INT64, 1, &dims);
  c.set(CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_TYPE_INT64, 2, dil);
  c.set(CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, CUDNN_TYPE_INT64, 2, stride);
  c.set(CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64, 2, pad);
  c.set(CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64, 2, pad);
  c.finalize();
  return c;
}

// The graph of a convolution in direction `dir`: one operation, or for a
// forward convolution with `add_residual` two (Note [Residual add in the
// epilogue]): the convolution into a virtual float tensor, then a pointwise
// add of the residual R into Y.
BackendDesc operation_graph(ConvDirection dir, const Conv2dGeometry& g, DType dtype, Layout layout,
                            int64_t alignment, cudnnHandle_t handle, bool add_residual = false,
                            bool gen_stats = false) {
  const cudnnDataType_t dt = cudnn_dtype(dtype, "conv2d");
  const BackendDesc x = tensor_desc(kUidX, dt, layout, {g.n, g.c_in, g.h, g.w}, alignment);
  const BackendDesc w =
      tensor_desc(kUidW, dt, layout, {g.c_out, g.c_in / g.groups, g.kh, g.kw}, alignment);
  const std::array<int64_t, 4> ydims{g.n, g.c_out, g.out_h(), g.out_w()};
  const BackendDesc y = add_residual ? tensor_desc(kUidConvOut, CUDNN_DATA_FLOAT, layout, ydims, alignment, true)
                                     : tensor_desc(kUidY, dt, layout, ydims, alignment);
  const BackendDesc conv = conv_desc(g);
  const float alpha = 1.0f, beta = 0.0f;
  BackendDesc op;
  switch (dir) {
    case ConvDirection::Forward:
      op = BackendDesc(CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR);
      op.set_desc(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, x);
      op.set_desc(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, w);
      op.set_desc(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y, y);
      op.set_desc(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC, conv);
      op.set(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA, CUDNN_TYPE_FLOAT, 1, &alpha);
      op.set(CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA, CUDNN_TYPE_FLOAT, 1, &beta);
      break;
    case ConvDirection::BackwardData:
      op = BackendDesc(CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR);
      op.set_desc(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX, x);
      op.set_desc(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W, w);
      op.set_desc(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY, y);
      op.set_desc(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC, conv);
      op.set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA, CUDNN_TYPE_FLOAT, 1, &alpha);
      op.set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA, CUDNN_TYPE_FLOAT, 1, &beta);
      break;
    case ConvDirection::BackwardFilter:
      op = BackendDesc(CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR);
      op.set_desc(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X, x);
      op.set_desc(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW, w);
      op.set_desc(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY, y);
      op.set_desc(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC, conv);
      op.set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA, CUDNN_TYPE_FLOAT, 1, &alpha);
      op.set(CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA, CUDNN_TYPE_FLOAT, 1, &beta);
      break;
  }
  op.finalize();
  BackendDesc graph(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  BackendDesc add;
  std::vector<cudnnBackendDescriptor_t> ops{op.get()};
  if (add_residual) {
    CHORUS_CHECK(dir == ConvDirection::Forward, "conv2d: a residual add is fused into forward convolutions only");
    const BackendDesc r = tensor_desc(kUidR, dt, layout, ydims, alignment);
    const BackendDesc out = tensor_desc(kUidY, dt, layout, ydims, alignment);
    BackendDesc pw(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    const cudnnPointwiseMode_t mode = CUDNN_POINTWISE_ADD;
    const cudnnDataType_t prec = CUDNN_DATA_FLOAT;
    pw.set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    pw.set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec);
    pw.finalize();
    add = BackendDesc(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    add.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw);
    add.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, y);
    add.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, r);
    add.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, out);
    add.finalize();
    ops.push_back(add.get());
  }
  // probe_conv_genstats: the per-channel sum and sum of squares of y.
  BackendDesc stats;
  if (gen_stats) {
    CHORUS_CHECK(dir == ConvDirection::Forward && !add_residual, "conv2d: statistics of a plain forward only");
    const BackendDesc sum = tensor_desc(kUidSum, CUDNN_DATA_FLOAT, layout, {1, g.c_out, 1, 1}, alignment);
    const BackendDesc sqsum = tensor_desc(kUidSqSum, CUDNN_DATA_FLOAT, layout, {1, g.c_out, 1, 1}, alignment);
    const cudnnGenStatsMode_t mode = CUDNN_GENSTATS_SUM_SQSUM;
    const cudnnDataType_t prec = CUDNN_DATA_FLOAT;
    stats = BackendDesc(CUDNN_BACKEND_OPERATION_GEN_STATS_DESCRIPTOR);
    stats.set(CUDNN_ATTR_OPERATION_GENSTATS_MODE, CUDNN_TYPE_GENSTATS_MODE, 1, &mode);
    stats.set(CUDNN_ATTR_OPERATION_GENSTATS_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec);
    stats.set_desc(CUDNN_ATTR_OPERATION_GENSTATS_XDESC, y);
    stats.set_desc(CUDNN_ATTR_OPERATION_GENSTATS_SUMDESC, sum);
    stats.set_desc(CUDNN_ATTR_OPERATION_GENSTATS_SQSUMDESC, sqsum);
    stats.finalize();
    ops.push_back(stats.get());
  }
  graph.set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<int64_t>(ops.size()), ops.data());
  graph.set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
  graph.finalize();
  return graph;
}

// Whether the engine of `cfg` computes with numerics this call may use.
bool numerics_allowed(const BackendDesc& cfg, DType dtype) {
  BackendDesc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
  cudnnBackendDescriptor_t e = engine.get();
  int64_t got = 0;
  if (cudnnBackendGetAttribute(cfg.get(), CUDNN_ATTR_ENGINECFG_ENGINE,
                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &got, &e) != CUDNN_STATUS_SUCCESS)
    return false;
  cudnnBackendNumericalNote_t notes[CUDNN_NUMERICAL_NOTE_TYPE_COUNT];
  int64_t n = 0;
  if (cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                               CUDNN_NUMERICAL_NOTE_TYPE_COUNT, &n,
                               notes) != CUDNN_STATUS_SUCCESS)
    return false;
  for (int64_t i = 0; i < n; ++i) {
    if (notes[i] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC && deterministic()) return false;
    if (dtype != kFloat32) continue;  // 16-bit data: tensor cores are the point
    // Float32 must stay float32 (down-converting engines compute in half), and
    // uses TF32 tensor cores only when allowed (Note [TF32 defaults] in blas.h).
    if (notes[i] == CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS) return false;
    if (notes[i] == CUDNN_NUMERICAL_NOTE_REDUCED_PRECISION_REDUCTION) return false;
    if (notes[i] == CUDNN_NUMERICAL_NOTE_TENSOR_CORE && !allow_tf32_conv()) return false;
  }
  return true;
}

struct Plan {
  BackendDesc desc;
  int64_t workspace = 0;
  std::string engine;  // describe_engine_config() of its engine configuration
};

// CHORUS_CONV_SEARCH_LOG=1: one stderr line per plan timed (engine, knobs,
// milliseconds) and per choice, to compare the search with another program's
// (issue 14: which kernels PyTorch's cudnn.benchmark finds that we do not).
bool search_log() {
  static const bool on = [] {
    const char* e = chorus::env::get("CHORUS_CONV_SEARCH_LOG");
    return e && *e && std::strcmp(e, "0") != 0;
  }();
  return on;
}

const char* direction_name(ConvDirection dir) {
  switch (dir) {
    case ConvDirection::Forward: return "fprop";
    case ConvDirection::BackwardData: return "dgrad";
    case ConvDirection::BackwardFilter: return "wgrad";
  }
  return "?";
}

// Finalises a plan for `cfg`, or returns null when cuDNN cannot.
std::shared_ptr<Plan> make_plan(const BackendDesc& cfg, cudnnHandle_t handle) {
  auto plan = std::make_shared<Plan>();
  plan->desc = BackendDesc(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
  plan->desc.set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
  plan->desc.set_desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, cfg);
  if (plan->desc.try_finalize() != CUDNN_STATUS_SUCCESS) return nullptr;
  int64_t got = 0;
  if (cudnnBackendGetAttribute(plan->desc.get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                               CUDNN_TYPE_INT64, 1, &got,
                               &plan->workspace) != CUDNN_STATUS_SUCCESS)
    return nullptr;
  plan->engine = describe_engine_config(cfg);
  return plan;
}

Tensor workspace_tensor(int64_t bytes, int device) {
  if (bytes <= 0) return Tensor();
  return detail::empty_tensor({bytes}, kUInt8, Device(DeviceType::CUDA, device));
}

cudnnStatus_t execute(const Plan& plan, cudnnHandle_t handle, const ConvOperands& ops,
                      void* workspace) {
  BackendDesc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  int64_t uids[5] = {kUidX, kUidW, kUidY, kUidR, 0};
  void* ptrs[5] = {ops.x, ops.w, ops.y, ops.r, nullptr};
  int64_t n = ops.r ? 4 : 3;
  if (ops.sum) {  // probe_conv_genstats (no residual then)
    CHORUS_CHECK(!ops.r && ops.sqsum, "conv2d: statistics need sum and sqsum, and no residual");
    uids[3] = kUidSum;
    ptrs[3] = ops.sum;
    uids[4] = kUidSqSum;
    ptrs[4] = ops.sqsum;
    n = 5;
  }
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids);
  pack.set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n, ptrs);
  pack.set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace);
  const cudnnStatus_t st = pack.try_finalize();
  if (st != CUDNN_STATUS_SUCCESS) return st;
  return cudnnBackendExecute(handle, plan.desc.get(), pack.get());
}

// Milliseconds of GPU time one run of `plan` takes on the current stream, or a
// negative number when it fails to run. The runs wait behind a gate until all
// are issued (Note [Timing behind a gate]), so an engine whose execute costs
// the host more than its kernel takes the GPU is timed by its kernel. (Timing
// each run from a flushed L2 instead of back to back chose plans no faster for
// WRN-28-10 or WRN-16-4 on an H200, within one run's noise: benchmarks journal,
// session 10; not kept.)
float time_plan(const Plan& plan, cudnnHandle_t handle, const ConvOperands& ops, int device) {
  Tensor ws;
  try {
    ws = workspace_tensor(plan.workspace, device);
  } catch (const OutOfMemoryError&) {
    return -1;
  }
  void* wp = ws.defined() ? ws.raw_data() : nullptr;
  if (execute(plan, handle, ops, wp) != CUDNN_STATUS_SUCCESS) {
    cudaGetLastError();  // a refused launch must not poison later error checks
    return -1;
  }
  // chorus::Event records on the device's current stream (the one `handle`
  // runs on) and is destroyed whatever throws in between.
  const Device dev(DeviceType::CUDA, device);
  Event start(dev), stop(dev);
  bool ok = true;
  bool host_bound = false;
  {
    // Note [Timing behind a gate]. (Timing without the gate, runs issued
    // back to back, chose the same plans for WRN-28-10: benchmarks journal,
    // session 12; that way was removed in session 39.)
    StreamGate gate(current_stream(device));
    start.record();
    for (int i = 0; i < kTimedRuns && ok; ++i) ok = execute(plan, handle, ops, wp) == CUDNN_STATUS_SUCCESS;
    stop.record();
    gate.open();
    stop.synchronize();
    host_bound = gate.expired();
  }
  const float ms = start.elapsed(stop);
  if (host_bound && search_log()) std::fprintf(stderr, "conv search: the gate expired; this timing includes the host\n");
  return ok ? ms / kTimedRuns : -1;
}

// Whether `plan` runs on these operands (its workspace allocated): one
// untimed run, for heuristic plans (Note [Heuristic plans]).
bool runs_once(const Plan& plan, cudnnHandle_t handle, const ConvOperands& ops, int device) {
  Tensor ws;
  try {
    ws = workspace_tensor(plan.workspace, device);
  } catch (const OutOfMemoryError&) {
    return false;
  }
  if (execute(plan, handle, ops, ws.defined() ? ws.raw_data() : nullptr) == CUDNN_STATUS_SUCCESS) return true;
  cudaGetLastError();  // a refused launch must not poison later error checks
  return false;
}

// Note [Plan search in a capture]: a geometry first seen while a CUDA graph is
// captured (Note [CUDA graphs]) is timed on a stream of its own that is not
// captured, since timing waits on the host; the chosen plan then runs on the
// captured stream. Its operands are real memory (the graph's pool), so the
// timing runs are as valid as anywhere.
class SearchStream {
 public:
  explicit SearchStream(int device) : device_(device), prev_(current_stream(device)) {
    if (!is_capturing(prev_)) return;
    static std::mutex mu;
    static std::vector<cudaStream_t>* streams = new std::vector<cudaStream_t>();  // leaked, one per device
    {
      std::lock_guard<std::mutex> g(mu);
      if (streams->size() <= static_cast<size_t>(device)) streams->resize(static_cast<size_t>(device) + 1, nullptr);
      cudaStream_t& s = (*streams)[static_cast<size_t>(device)];
      if (!s) {
        CudaDeviceGuard guard(device);
        CHORUS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      }
      side_ = s;
    }
    set_current_stream(device, side_);
  }
  ~SearchStream() {
    if (!side_) return;
    set_current_stream(device_, prev_);
  }
  SearchStream(const SearchStream&) = delete;
  SearchStream& operator=(const SearchStream&) = delete;

 private:
  int device_;
  cudaStream_t prev_;
  cudaStream_t side_ = nullptr;
};

std::shared_ptr<Plan> search(ConvDirection dir, const Conv2dGeometry& g, DType dtype,
                             Layout layout, int64_t alignment, int device,
                             const ConvOperands& ops) {
  SearchStream off_capture(device);  // Note [Plan search in a capture]
  cudnnHandle_t handle = cudnn_handle(device);
  BackendDesc graph;
  try {
    graph = operation_graph(dir, g, dtype, layout, alignment, handle, ops.r != nullptr);
  } catch (const DeviceError&) {
    return nullptr;  // a geometry the graph API does not describe: legacy path
  }
  std::shared_ptr<Plan> best;
  float best_ms = 0;
  size_t tried = 0;
  std::string best_name;
  const bool log = search_log();
  for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    // The fallback list is only for geometries the heuristics found nothing for.
    if (mode == CUDNN_HEUR_MODE_FALLBACK && best) break;
    for (const BackendDesc& cfg : engine_configs(graph, mode)) {
      if (tried >= kMaxCandidates) break;
      if (!numerics_allowed(cfg, dtype)) continue;
      std::shared_ptr<Plan> plan = make_plan(cfg, handle);
      if (!plan || plan->workspace > kMaxWorkspaceBytes) continue;
      ++tried;
      if (heuristic_plans()) {  // Note [Heuristic plans]: the first that runs, once, untimed
        if (!runs_once(*plan, handle, ops, device)) continue;
        if (log) best_name = describe_engine_config(cfg);
        best = plan;
        break;
      }
      const float ms = time_plan(*plan, handle, ops, device);
      if (log)
        std::fprintf(stderr, "conv search: %s n%lld c%lld %lldx%lld k%lld r%lld s%lld: %s %s ws %lld: %.4f ms\n",
                     direction_name(dir), (long long)g.n, (long long)g.c_in, (long long)g.h, (long long)g.w,
                     (long long)g.c_out, (long long)g.kh, (long long)g.stride_h,
                     mode == CUDNN_HEUR_MODE_A ? "A" : "fallback", describe_engine_config(cfg).c_str(),
                     (long long)plan->workspace, ms);
      if (ms >= 0 && (!best || ms < best_ms)) {
        best = plan;
        best_ms = ms;
        if (log) best_name = describe_engine_config(cfg);
      }
    }
  }
  if (log && best && heuristic_plans())
    std::fprintf(stderr, "conv search: %s n%lld c%lld %lldx%lld k%lld r%lld s%lld: took %s (heuristic, untimed)\n",
                 direction_name(dir), (long long)g.n, (long long)g.c_in, (long long)g.h, (long long)g.w,
                 (long long)g.c_out, (long long)g.kh, (long long)g.stride_h, best_name.c_str());
  else if (log && best)
    std::fprintf(stderr, "conv search: %s n%lld c%lld %lldx%lld k%lld r%lld s%lld: chose %s (%.4f ms of %zu)\n",
                 direction_name(dir), (long long)g.n, (long long)g.c_in, (long long)g.h, (long long)g.w,
                 (long long)g.c_out, (long long)g.kh, (long long)g.stride_h, best_name.c_str(), best_ms, tried);
  return best;
}

// ---- one choice per kind of GPU -----------------------------------------------------------

// Note [One plan choice per kind of GPU]: the search times candidates a few
// runs each, and near-ties fall either way from run to run. Searched on each
// GPU, DataParallel's replicas then ran different kernels for one layer (2
// H100s, WRN-28-10 bf16: cuda:0 took a slower plan for 7 backward-data
// convolutions, cuda:1 one for 7 forward ones; benchmarks journal, session 17),
// and in a synchronous step the slowest replica sets the pace: each GPU
// waited for the other's slow layers inside the all-reduce. So the first
// device of a kind (same name, compute capability and SM count) to meet a
// geometry searches, the others of its kind wait for that search and rebuild
// the same engine configuration on their own handle (no timing); where it
// does not build there, they search themselves.
// Measured against a search on every device (2 H100s, WRN-28-10 and WRN-16-4
// bf16 DataParallel, same machine, two runs each; benchmarks journal, session
// 17): no faster, within noise, so it is not the default: CHORUS_CONV_SEARCH_SHARED=1 (or
// set_shared_plan_choices) turns it on, for identical kernels on every
// replica and one search per geometry instead of one per GPU.
int kind_of(int device) {
  const cudaDeviceProp& p = device_properties(device);
  for (int d = 0; d < device; ++d) {
    const cudaDeviceProp& q = device_properties(d);
    if (std::strcmp(p.name, q.name) == 0 && p.major == q.major && p.minor == q.minor &&
        p.multiProcessorCount == q.multiProcessorCount)
      return d;
  }
  return device;
}

// The chosen engine configuration (describe_engine_config(); "" for none) per geometry and
// kind of GPU, searched once: a thread that finds the search under way waits
// for it.
class ChoiceCache {
 public:
  // `search` runs on the first caller's thread; the others get its result,
  // or nullopt where it threw (the first caller rethrows).
  template <typename Search>
  std::optional<std::string> get_or_search(const ConvKey& k, Search&& search) {
    std::shared_future<std::string> result;
    std::optional<std::promise<std::string>> mine;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = map_.find(k);
      if (it != map_.end()) {
        result = it->second;
      } else {
        mine.emplace();
        result = mine->get_future().share();
        map_.emplace(k, result);
      }
    }
    if (!mine) {
      try {
        return result.get();
      } catch (...) {
        return std::nullopt;
      }
    }
    try {
      std::string v = search();
      mine->set_value(v);
      return v;
    } catch (...) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        map_.erase(k);  // a later caller searches again
      }
      mine->set_exception(std::current_exception());
      throw;
    }
  }

 private:
  std::mutex mu_;
  std::unordered_map<ConvKey, std::shared_future<std::string>, IntKeyHash> map_;
};

std::atomic<int64_t> searches_run{0}, choices_reused{0};

ChoiceCache& choice_cache() {
  static auto* cache = new ChoiceCache;  // leaked: used from threads that may outlive statics
  return *cache;
}

// The plan of engine configuration `engine` for this geometry on `device`, or
// null where it does not build there.
std::shared_ptr<Plan> rebuild(const std::string& engine, ConvDirection dir, const Conv2dGeometry& g, DType dtype,
                              Layout layout, int64_t alignment, int device, bool add_residual) {
  cudnnHandle_t handle = cudnn_handle(device);
  BackendDesc graph;
  try {
    graph = operation_graph(dir, g, dtype, layout, alignment, handle, add_residual);
  } catch (const DeviceError&) {
    return nullptr;
  }
  for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK})
    for (const BackendDesc& cfg : engine_configs(graph, mode)) {
      if (engine.find('?') != std::string::npos || describe_engine_config(cfg) != engine) continue;  // "engine ?": no identity
      std::shared_ptr<Plan> plan = make_plan(cfg, handle);
      if (plan && plan->workspace <= kMaxWorkspaceBytes) return plan;
      return nullptr;
    }
  return nullptr;
}

// search(), once per kind of GPU (Note [One plan choice per kind of GPU]).
std::shared_ptr<Plan> shared_search(const ConvKey& key, ConvDirection dir, const Conv2dGeometry& g, DType dtype,
                                    Layout layout, int64_t alignment, int device, const ConvOperands& ops) {
  if (!shared_plan_choices()) {
    searches_run.fetch_add(1);
    return search(dir, g, dtype, layout, alignment, device, ops);
  }
  ConvKey by_kind = key;
  by_kind[1] = kind_of(device);
  std::shared_ptr<Plan> here;
  bool searched = false;
  const std::optional<std::string> chosen = choice_cache().get_or_search(by_kind, [&] {
    here = search(dir, g, dtype, layout, alignment, device, ops);
    searched = true;
    searches_run.fetch_add(1);
    return here ? here->engine : std::string();
  });
  if (searched) return here;
  if (chosen && chosen->empty()) {  // no plan on this kind of GPU: the legacy path
    choices_reused.fetch_add(1);
    return nullptr;
  }
  if (chosen)
    if (std::shared_ptr<Plan> plan = rebuild(*chosen, dir, g, dtype, layout, alignment, device, ops.r != nullptr)) {
      if (search_log())
        std::fprintf(stderr, "conv search: %s n%lld c%lld %lldx%lld k%lld r%lld s%lld on cuda:%d: took %s, chosen on cuda:%lld\n",
                     direction_name(dir), (long long)g.n, (long long)g.c_in, (long long)g.h, (long long)g.w,
                     (long long)g.c_out, (long long)g.kh, (long long)g.stride_h, device, chosen->c_str(),
                     (long long)by_kind[1]);
      choices_reused.fetch_add(1);
      return plan;
    }
  searches_run.fetch_add(1);
  return search(dir, g, dtype, layout, alignment, device, ops);
}

// ---- the plan cache ---------------------------------------------------------------------

// A null plan records "no engine": the legacy path handles that geometry.
using PlanCache = LockedCache<ConvKey, std::shared_ptr<Plan>>;
PlanCache& plan_cache() {
  static auto* cache = new PlanCache;  // leaked: used from threads that may outlive statics
  return *cache;
}

}  // namespace

ConvKey conv_key(ConvDirection dir, const Conv2dGeometry& g, DType dtype, Layout layout,
                 int device, int64_t numerics, const ConvOperands& ops) {
  return {static_cast<int64_t>(dir), device,    static_cast<int64_t>(dtype),
          static_cast<int64_t>(layout), numerics, common_alignment(ops),
          g.n,  g.c_in,  g.h,  g.w,  g.c_out,  g.kh,  g.kw,  g.stride_h,  g.stride_w,
          g.pad_h,  g.pad_w,  g.dil_h,  g.dil_w,  g.groups};
}

int64_t common_alignment(const ConvOperands& ops) {
  const uint64_t bits = reinterpret_cast<uint64_t>(ops.x) | reinterpret_cast<uint64_t>(ops.w) |
                        reinterpret_cast<uint64_t>(ops.y) | reinterpret_cast<uint64_t>(ops.r) |
                        reinterpret_cast<uint64_t>(ops.sum) | reinterpret_cast<uint64_t>(ops.sqsum) | 16u;
  return static_cast<int64_t>(bits & (~bits + 1));
}

ConvSearchCounts conv_search_counts() { return {searches_run.load(), choices_reused.load()}; }

bool conv_graph_enabled() {
  static const bool enabled = [] {
    const char* e = chorus::env::get("CHORUS_CUDNN_LEGACY");
    return !(e && *e && std::strcmp(e, "0") != 0);
  }();
  return enabled;
}

bool conv_search_log() { return search_log(); }

GenStatsProbe probe_conv_genstats(const Conv2dGeometry& g, DType dtype, Layout layout, int device,
                                  const ConvOperands& ops) {
  GenStatsProbe out;
  CHORUS_CHECK(ops.sum && ops.sqsum && !ops.r, "probe_conv_genstats: needs sum and sqsum, and no residual");
  const cudnnHandle_t handle = cudnn_handle(device);
  BackendDesc graph;
  try {
    graph = operation_graph(ConvDirection::Forward, g, dtype, layout, common_alignment(ops), handle, false, true);
  } catch (const Error& e) {
    out.error = e.what();
    return out;
  }
  std::shared_ptr<Plan> best;
  for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    for (const BackendDesc& cfg : engine_configs(graph, mode)) {
      ++out.configs;
      const std::shared_ptr<Plan> plan = make_plan(cfg, handle);
      if (!plan || plan->workspace > kMaxWorkspaceBytes) continue;
      const float ms = time_plan(*plan, handle, ops, device);
      if (ms < 0) continue;
      ++out.plans;
      if (out.best_ms < 0 || ms < out.best_ms) {
        out.best_ms = ms;
        out.engine = plan->engine;
        best = plan;
      }
    }
  }
  // The sums as one run of the fastest plan leaves them (whether GEN_STATS
  // overwrites or adds, the caller's check sees one run).
  if (best) {
    const int64_t bytes = g.c_out * static_cast<int64_t>(sizeof(float));
    CHORUS_CUDA_CHECK(cudaMemsetAsync(ops.sum, 0, bytes, current_stream(device)));
    CHORUS_CUDA_CHECK(cudaMemsetAsync(ops.sqsum, 0, bytes, current_stream(device)));
    Tensor ws = workspace_tensor(best->workspace, device);
    const cudnnStatus_t st = execute(*best, handle, ops, ws.defined() ? ws.raw_data() : nullptr);
    if (st != CUDNN_STATUS_SUCCESS) throw_cudnn_error(st, "cudnnBackendExecute (conv2d + statistics)", __FILE__, __LINE__);
  }
  return out;
}

bool run_conv_graph(ConvDirection dir, const Conv2dGeometry& g, DType dtype, Layout layout,
                    int device, const ConvOperands& ops) {
  if (!conv_graph_enabled()) return false;
  const ConvKey key =
      conv_key(dir, g, dtype, layout, device,
               (dtype == kFloat32 && allow_tf32_conv() ? 1 : 0) | (deterministic() ? 2 : 0) | (heuristic_plans() ? 4 : 0) |
                   (ops.r ? 8 : 0),
               ops);
  const std::shared_ptr<Plan> plan = plan_cache().get_or_search(
      key, [&] { return shared_search(key, dir, g, dtype, layout, common_alignment(ops), device, ops); });
  if (!plan) return false;
  Tensor ws = workspace_tensor(plan->workspace, device);
  const cudnnStatus_t st =
      execute(*plan, cudnn_handle(device), ops, ws.defined() ? ws.raw_data() : nullptr);
  if (st != CUDNN_STATUS_SUCCESS) throw_cudnn_error(st, "cudnnBackendExecute (conv2d)", __FILE__, __LINE__);
  return true;
}

}  // namespace chorus::cuda

CHORUS_CUDNN_LEGACY_END
