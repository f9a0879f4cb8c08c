// Fused (flash) attention through cuDNN's backend graph API: the kernel-set
// entries attention_fused_forward/backward (core/kernel_set.h).
//
// Note [Fused attention graphs]: cuDNN runs scaled-dot-product attention as
// one fused kernel (FlashAttention-2/3 style: tiles of Q against tiles of K
// and V in on-chip memory, an online softmax, the [T, S] scores never written
// to memory) when it is handed an operation graph of the exact shape its
// fused engines recognise. The graphs below are the ones cudnn-frontend's
// composite SDPA nodes build (node/scaled_dot_product_flash_attention.h,
// utils/attn_score_modifiers.h; karpathy/llm.c trains through them), written
// against the backend API because the frontend is a header library outside
// Debian and the CUDA toolkit:
//   forward:  S = Q K^T * scale; causal: S = (row >= col) ? S : -inf;
//             M = max_j S, E = exp(S - M), Z = sum_j E; stats = M + log Z;
//             O = (E / Z) V
//   backward: D = sum_d dO * O (a float workspace); E = exp(S * scale - stats)
//             (masked), dV = E^T dO, dS = (dO V^T - D) * E * scale,
//             dK = dS^T Q, dQ = dS K through a float accumulator.
// Q, K, V, O and their gradients are strided views: the GPT's are slices of
// its [B, T, 3C] QKV projection and [B, T, C] output, read and written in
// place with no head permutes. A graph cuDNN refuses (an old cuDNN, a GPU or
// a head size without a fused engine, float32) makes the entries return
// false, and ops/ takes the composite path; the reason is kept for the error
// a caller who asked for the fused kernel gets (fused_attention_refusal).
#include <array>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "chorus/core/env_switches.h"
#include "chorus/core/error.h"
#include "chorus/core/graph_capture.h"
#include "chorus/cuda/blas/blas.h"
#include "chorus/cuda/runtime/caches.h"
#include "chorus/cuda/runtime/context.h"
#include "chorus/cuda/cudnn/cudnn_backend.h"
#include "chorus/cuda/kernels/kernels.h"
#include "chorus/cuda/runtime/search_switch.h"
#include "chorus/cuda/runtime/time_calls.h"

// The graph and plan descriptors take the handle through attributes cuDNN
// 9.19 marks deprecated; they work in every cuDNN 9 (as in conv_plan.cpp).
CHORUS_CUDNN_LEGACY_BEGIN

namespace chorus::cuda {

namespace {

using Dims = std::array<int64_t, 4>;

// Unique ids of the tensors a variant pack names (virtual ones count up from
// kFirstVirtual).
enum : int64_t {
  kUidQ = 1, kUidK, kUidV, kUidO, kUidStats, kUidDO, kUidDQ, kUidDK, kUidDV, kUidSoftmaxSum, kUidDQAccum,
  kUidScale, kUidOne, kUidNegInf, kFirstVirtual = 100
};

// A cuDNN refusal while building or planning a graph: `what` names the step.
struct Refused {
  std::string what;
};

void need(cudnnStatus_t st, const char* what) {
  if (st != CUDNN_STATUS_SUCCESS) throw Refused{std::string(what) + ": " + cudnnGetErrorString(st)};
}

Dims packed(const Dims& d) { return {d[1] * d[2] * d[3], d[2] * d[3], d[3], 1}; }
Dims swap23(Dims d) {
  std::swap(d[2], d[3]);
  return d;
}

// Builds one operation graph; keeps every descriptor alive until the graph
// (and the plans made from it) are final.
class GraphBuilder {
 public:
  const BackendDesc& tensor(int64_t uid, const Dims& dims, const Dims& strides, cudnnDataType_t dt,
                            bool is_virtual = false, bool by_value = false) {
    BackendDesc& t = keep_.emplace_back(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const int64_t alignment = 16;
    t.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt);
    t.set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data());
    t.set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data());
    t.set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
    t.set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment);
    if (is_virtual) t.set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual);
    if (by_value) t.set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value);
    need(t.try_finalize(), "tensor descriptor");
    return t;
  }
  // A virtual (never stored) tensor, packed unless strides are given.
  const BackendDesc& virt(const Dims& dims, cudnnDataType_t dt = CUDNN_DATA_FLOAT) {
    return tensor(next_uid_++, dims, packed(dims), dt, true);
  }
  const BackendDesc& virt(const Dims& dims, const Dims& strides, cudnnDataType_t dt) {
    return tensor(next_uid_++, dims, strides, dt, true);
  }
  // A float scalar passed by value in the variant pack.
  const BackendDesc& scalar(int64_t uid) { return tensor(uid, {1, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_FLOAT, false, true); }

  void pointwise(cudnnPointwiseMode_t mode, const BackendDesc& x, const BackendDesc* b, const BackendDesc* t,
                 const BackendDesc& y, cudnnDataType_t prec = CUDNN_DATA_FLOAT, int64_t axis = -1) {
    BackendDesc& pw = keep_.emplace_back(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    pw.set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    pw.set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec);
    if (axis >= 0) pw.set(CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
    need(pw.try_finalize(), "pointwise descriptor");
    BackendDesc& op = keep_.emplace_back(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw);
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x);
    if (b) op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, *b);
    if (t) op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, *t);
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
    need(op.try_finalize(), "pointwise operation");
    ops_.push_back(op.get());
  }
  // y = op(x) for a unary mode, op(x, b) for a binary one.
  const BackendDesc& unary(cudnnPointwiseMode_t mode, const BackendDesc& x, const Dims& dims) {
    const BackendDesc& y = virt(dims);
    pointwise(mode, x, nullptr, nullptr, y);
    return y;
  }
  const BackendDesc& binary(cudnnPointwiseMode_t mode, const BackendDesc& x, const BackendDesc& b, const Dims& dims) {
    const BackendDesc& y = virt(dims);
    pointwise(mode, x, &b, nullptr, y);
    return y;
  }
  void reduction(cudnnReduceTensorOp_t mode, const BackendDesc& x, const BackendDesc& y) {
    BackendDesc& r = keep_.emplace_back(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    r.set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode);
    r.set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp);
    need(r.try_finalize(), "reduction descriptor");
    BackendDesc& op = keep_.emplace_back(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_DESC, r);
    op.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x);
    op.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y);
    need(op.try_finalize(), "reduction operation");
    ops_.push_back(op.get());
  }
  void matmul(const BackendDesc& a, const BackendDesc& b, const BackendDesc& c) {
    BackendDesc& m = keep_.emplace_back(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    m.set(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp);
    need(m.try_finalize(), "matmul descriptor");
    BackendDesc& op = keep_.emplace_back(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_ADESC, a);
    op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_BDESC, b);
    op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_CDESC, c);
    op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_DESC, m);
    need(op.try_finalize(), "matmul operation");
    ops_.push_back(op.get());
  }
  void reshape(const BackendDesc& x, const BackendDesc& y) {
    BackendDesc& op = keep_.emplace_back(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x);
    op.set_desc(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y);
    need(op.try_finalize(), "reshape operation");
    ops_.push_back(op.get());
  }
  // The causal mask of top-left alignment (query i sees keys 0..i):
  // scores where row >= col, -inf elsewhere.
  const BackendDesc& causal_mask(const BackendDesc& s, const Dims& dims) {
    const BackendDesc& row = virt(dims, CUDNN_DATA_INT32);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, nullptr, row, CUDNN_DATA_FLOAT, 2);
    const BackendDesc& col = virt(dims, CUDNN_DATA_INT32);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, nullptr, col, CUDNN_DATA_FLOAT, 3);
    const BackendDesc& keep = virt(dims, CUDNN_DATA_BOOLEAN);
    pointwise(CUDNN_POINTWISE_CMP_GE, row, &col, nullptr, keep, CUDNN_DATA_BOOLEAN);
    const BackendDesc& out = virt(dims);
    pointwise(CUDNN_POINTWISE_BINARY_SELECT, s, &scalar(kUidNegInf), &keep, out);
    return out;
  }

  BackendDesc finish(cudnnHandle_t handle) {
    BackendDesc graph(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    graph.set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<int64_t>(ops_.size()),
              ops_.data());
    graph.set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
    need(graph.try_finalize(), "operation graph");
    return graph;
  }

 private:
  std::deque<BackendDesc> keep_;  // stable addresses: descriptors refer to each other
  std::vector<cudnnBackendDescriptor_t> ops_;
  int64_t next_uid_ = kFirstVirtual;
};

// Shapes and strides of one call, the key of its plan.
struct Problem {
  int64_t b, h, t, s, d;
  cudnnDataType_t dt;
  bool causal, backward;
  Dims q, k, v, o, dout, dq, dk, dv;  // element strides ([B, H, seq, D] order)

  std::vector<int64_t> key(int device) const {
    std::vector<int64_t> out{device, b, h, t, s, d, static_cast<int64_t>(dt), causal, backward};
    for (const Dims* st : {&q, &k, &v, &o, &dout, &dq, &dk, &dv}) out.insert(out.end(), st->begin(), st->end());
    return out;
  }
};

Dims strides_of(const Tensor& x) {
  if (!x.defined()) return {0, 0, 0, 0};
  return {x.stride(0), x.stride(1), x.stride(2), x.stride(3)};
}

BackendDesc forward_graph(const Problem& p, cudnnHandle_t handle) {
  GraphBuilder g;
  const Dims sd{p.b, p.h, p.t, p.s}, rows{p.b, p.h, p.t, 1};
  const BackendDesc& q = g.tensor(kUidQ, {p.b, p.h, p.t, p.d}, p.q, p.dt);
  const BackendDesc& kt = g.tensor(kUidK, {p.b, p.h, p.d, p.s}, swap23(p.k), p.dt);
  const BackendDesc& v = g.tensor(kUidV, {p.b, p.h, p.s, p.d}, p.v, p.dt);
  const BackendDesc& s = g.virt(sd);
  g.matmul(q, kt, s);
  const BackendDesc* x = &g.binary(CUDNN_POINTWISE_MUL, s, g.scalar(kUidScale), sd);
  if (p.causal) x = &g.causal_mask(*x, sd);
  const BackendDesc& mx = g.virt(rows);
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, *x, mx);
  const BackendDesc& e = g.unary(CUDNN_POINTWISE_EXP, g.binary(CUDNN_POINTWISE_SUB, *x, mx, sd), sd);
  const BackendDesc& z = g.virt(rows);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, z);
  const BackendDesc& stats = g.tensor(kUidStats, rows, packed(rows), CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_ADD, mx, &g.unary(CUDNN_POINTWISE_LOG, z, rows), nullptr, stats);
  // The probabilities enter the second product in the data's own type, as
  // cuDNN's fused engines require.
  const BackendDesc& probs = g.virt(sd, packed(sd), p.dt);
  g.pointwise(CUDNN_POINTWISE_DIV, e, &z, nullptr, probs);
  const BackendDesc& o = g.tensor(kUidO, {p.b, p.h, p.t, p.d}, p.o, p.dt);
  g.matmul(probs, v, o);
  return g.finish(handle);
}

BackendDesc backward_graph(const Problem& p, cudnnHandle_t handle) {
  GraphBuilder g;
  const Dims td{p.b, p.h, p.t, p.d}, sdim{p.b, p.h, p.s, p.d}, sd{p.b, p.h, p.t, p.s}, rows{p.b, p.h, p.t, 1};
  const BackendDesc& q = g.tensor(kUidQ, td, p.q, p.dt);
  const BackendDesc& kt = g.tensor(kUidK, {p.b, p.h, p.d, p.s}, swap23(p.k), p.dt);
  const BackendDesc& vt = g.tensor(kUidV, {p.b, p.h, p.d, p.s}, swap23(p.v), p.dt);
  const BackendDesc& o = g.tensor(kUidO, td, p.o, p.dt);
  const BackendDesc& dout = g.tensor(kUidDO, td, p.dout, p.dt);
  const BackendDesc& stats = g.tensor(kUidStats, rows, packed(rows), CUDNN_DATA_FLOAT);
  // D = rowsum(dO * O), stored (a float workspace the fused kernel reads).
  const BackendDesc& dsum = g.virt(rows);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, g.binary(CUDNN_POINTWISE_MUL, dout, o, td), dsum);
  const BackendDesc& softmax_sum = g.tensor(kUidSoftmaxSum, rows, packed(rows), CUDNN_DATA_FLOAT);
  g.pointwise(CUDNN_POINTWISE_MUL, dsum, &g.scalar(kUidOne), nullptr, softmax_sum);
  // The probabilities again, from the forward's log-sum-exp.
  const BackendDesc& s = g.virt(sd);
  g.matmul(q, kt, s);
  const BackendDesc* x = &g.binary(CUDNN_POINTWISE_MUL, s, g.scalar(kUidScale), sd);
  x = &g.binary(CUDNN_POINTWISE_SUB, *x, stats, sd);
  if (p.causal) x = &g.causal_mask(*x, sd);
  const BackendDesc& e = g.unary(CUDNN_POINTWISE_EXP, *x, sd);
  const Dims transposed{p.h * p.t * p.s, p.t * p.s, 1, p.s};
  const BackendDesc& pt = g.virt({p.b, p.h, p.s, p.t}, transposed, p.dt);
  g.reshape(e, pt);
  g.matmul(pt, dout, g.tensor(kUidDV, sdim, p.dv, p.dt));
  const BackendDesc& dp = g.virt(sd);
  g.matmul(dout, vt, dp);
  const BackendDesc& ds0 = g.binary(CUDNN_POINTWISE_MUL, g.binary(CUDNN_POINTWISE_SUB, dp, softmax_sum, sd), e, sd);
  const BackendDesc& ds = g.binary(CUDNN_POINTWISE_MUL, ds0, g.scalar(kUidScale), sd);
  const BackendDesc& dst = g.virt({p.b, p.h, p.s, p.t}, transposed, p.dt);
  g.reshape(ds, dst);
  g.matmul(dst, q, g.tensor(kUidDK, sdim, p.dk, p.dt));
  const BackendDesc& k = g.virt(sdim, p.k, p.dt);
  g.reshape(kt, k);
  const BackendDesc& dq_accum = g.tensor(kUidDQAccum, td, packed(td), CUDNN_DATA_FLOAT);
  g.matmul(ds, k, dq_accum);
  g.pointwise(CUDNN_POINTWISE_IDENTITY, dq_accum, nullptr, nullptr, g.tensor(kUidDQ, td, p.dq, p.dt));
  return g.finish(handle);
}

// Note [Attention plan search]: cuDNN's heuristics rank the fused-attention
// engine's configurations by a model of the GPU, and cudnn-frontend (llm.c
// through it) builds the first that works; the engine also declares knobs --
// among them the kernel configuration, the fused kernel's tile shapes (the
// "knob_26_64x64x64" in its name) -- whose other values the heuristics never
// offer. So the first eager call of a problem (shapes, strides, dtype, causal,
// direction) makes plans of the heuristics' configurations (mode A, then the
// fallback list) and, beside the first of them, of its knob neighbours
// (knob_neighbours in cudnn_backend.h: one knob moved at a time over the
// values the engine declares), at most kMaxAttentionPlans, times each on the
// call's own operands (cuda/runtime/time_calls.h: one untimed run, three
// behind a gate) and keeps the fastest, as the GEMM and convolution searches
// do (Note [Timed GEMM algorithm search] in blas/gemm_search.h, Note [Plan
// search] in conv/conv_plan.h). Running a plan again is harmless: the forward
// overwrites O and the stats, the backward dQ, dK, dV and its own scratch, and
// the inputs are only read. A call inside a CUDA graph capture takes the first
// plan untimed (timing waits on the host) and the problem's next eager call
// searches; training runs eager steps before it captures
// (parallel/graphed_step.h). CHORUS_ATTENTION_SEARCH=heuristic, and
// deterministic mode (timed choices between near ties can differ from one
// process to the next), take the first plan everywhere; the two modes' choices
// are cached apart. CHORUS_ATTENTION_SEARCH_LOG=1 prints each plan timed.
constexpr size_t kMaxAttentionPlans = 32;

struct Plan {
  BackendDesc desc;
  int64_t workspace = 0;
  std::string engine;  // describe_engine_config(): the engine and its knobs
};

// Whether cuDNN notes an engine configuration as nondeterministic.
bool nondeterministic(const BackendDesc& cfg) {
  BackendDesc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
  cudnnBackendDescriptor_t e = engine.get();
  int64_t got = 0, n = 0;
  cudnnBackendNumericalNote_t notes[CUDNN_NUMERICAL_NOTE_TYPE_COUNT];
  bool found = false;
  if (cudnnBackendGetAttribute(cfg.get(), CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &got, &e) ==
          CUDNN_STATUS_SUCCESS &&
      cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                               CUDNN_NUMERICAL_NOTE_TYPE_COUNT, &n, notes) == CUDNN_STATUS_SUCCESS)
    for (int64_t i = 0; i < n; ++i) found |= notes[i] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC;
  return found;
}

// The execution plan of one configuration; null, with `why` set, when cuDNN
// will not make it.
std::shared_ptr<Plan> plan_of(const BackendDesc& cfg, cudnnHandle_t handle, std::string* why) {
  auto plan = std::make_shared<Plan>();
  plan->desc = BackendDesc(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
  plan->desc.set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
  plan->desc.set_desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, cfg);
  const cudnnStatus_t st = plan->desc.try_finalize();
  if (st != CUDNN_STATUS_SUCCESS) {
    *why = std::string("execution plan: ") + cudnnGetErrorString(st);
    return nullptr;
  }
  int64_t got = 0;
  need(cudnnBackendGetAttribute(plan->desc.get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &got,
                                &plan->workspace),
       "plan workspace size");
  plan->engine = describe_engine_config(cfg);
  return plan;
}

// The plans to choose from, the heuristics' first (the one used untimed)
// first; with `search` also the rest of their lists and the first's knob
// neighbours. Deterministic mode skips engines that say they are not.
std::vector<std::shared_ptr<Plan>> make_plans(const BackendDesc& graph, cudnnHandle_t handle, bool search) {
  std::vector<std::shared_ptr<Plan>> plans;
  std::set<std::string> seen;  // a neighbour may repeat a listed configuration
  auto add = [&](const std::shared_ptr<Plan>& plan) {
    if (plan && (plan->engine.find('?') != std::string::npos || seen.insert(plan->engine).second)) plans.push_back(plan);
  };
  std::string last = "no engine configuration", ignored;
  KnobNeighbours around;  // the configurations refer to its engine: alive until their plans are final
  for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    for (const BackendDesc& cfg : engine_configs(graph, mode)) {
      if (deterministic() && nondeterministic(cfg)) {
        last = "only nondeterministic engines (CHORUS_DETERMINISTIC is set)";
        continue;
      }
      const size_t before = plans.size();
      add(plan_of(cfg, handle, &last));
      if (plans.size() == before) continue;
      if (!search) return plans;
      if (plans.size() == 1) {
        around = knob_neighbours(graph, cfg, 4 * kMaxAttentionPlans);
        for (const BackendDesc& n : around.configs) {
          if (plans.size() >= kMaxAttentionPlans) break;
          add(plan_of(n, handle, &ignored));
        }
      }
      if (plans.size() >= kMaxAttentionPlans) return plans;
    }
  }
  if (plans.empty()) throw Refused{last};
  return plans;
}

SearchSwitch search_switch("CHORUS_ATTENTION_SEARCH");
std::atomic<int64_t> searches_run{0};

bool search_log() {
  static const bool on = [] {
    const char* e = chorus::env::get("CHORUS_ATTENTION_SEARCH_LOG");
    return e && *e && std::strcmp(e, "0") != 0;
  }();
  return on;
}

struct Entry {
  std::shared_ptr<Plan> plan;  // null: refused
  bool timed = false;          // false: the first plan, to be searched at the next eager call
};

struct PlanCache {
  std::mutex mu;
  std::map<std::vector<int64_t>, Entry> plans;
  std::string refusal;  // the latest reason
};
PlanCache& plan_cache() {
  static auto* c = new PlanCache;  // never destroyed: plans outlive static teardown order
  return *c;
}

// Runs a plan on the call's own operands; cuDNN's status.
using RunPlan = std::function<cudnnStatus_t(const Plan&)>;

// The plan for `p` on `device`, built once, searched (timed with `run_plan`)
// at the first call that may; null when cuDNN refuses the problem.
std::shared_ptr<Plan> plan_for(const Problem& p, int device, const RunPlan& run_plan) {
  PlanCache& c = plan_cache();
  const bool heuristic = heuristic_attention_plans();
  const bool search = !heuristic && !capture_in_progress();
  std::vector<int64_t> key = p.key(device);
  key.push_back(heuristic);
  {
    std::lock_guard<std::mutex> lock(c.mu);
    auto it = c.plans.find(key);
    if (it != c.plans.end() && (it->second.timed || !search || !it->second.plan)) return it->second.plan;
  }
  CudaDeviceGuard guard(device);
  cudnnHandle_t handle = cudnn_handle(device);
  Entry entry;
  std::string why;
  try {
    const BackendDesc graph = p.backward ? backward_graph(p, handle) : forward_graph(p, handle);
    const std::vector<std::shared_ptr<Plan>> plans = make_plans(graph, handle, search);
    entry.plan = plans.front();
    entry.timed = search;
    if (search) searches_run.fetch_add(1, std::memory_order_relaxed);
    if (search && plans.size() > 1) {
      float best_ms = -1;
      for (const auto& plan : plans) {
        const float ms = time_calls(device, [&] { return run_plan(*plan) == CUDNN_STATUS_SUCCESS; });
        if (search_log())
          std::fprintf(stderr, "attention search: %s b%lld h%lld t%lld s%lld d%lld%s: %s ws %lld: %.4f ms\n",
                       p.backward ? "backward" : "forward", (long long)p.b, (long long)p.h, (long long)p.t,
                       (long long)p.s, (long long)p.d, p.causal ? " causal" : "", plan->engine.c_str(),
                       (long long)plan->workspace, ms);
        if (ms >= 0 && (best_ms < 0 || ms < best_ms)) {
          best_ms = ms;
          entry.plan = plan;
        }
      }
      if (search_log()) std::fprintf(stderr, "attention search: kept %s (%.4f ms)\n", entry.plan->engine.c_str(), best_ms);
    }
  } catch (const Refused& r) {
    why = r.what;
  } catch (const DeviceError& e) {  // an attribute cuDNN would not take
    why = e.what();
  }
  std::lock_guard<std::mutex> lock(c.mu);
  if (!entry.plan) c.refusal = std::string(p.backward ? "backward" : "forward") + " graph refused at " + why;
  return (c.plans[key] = entry).plan;
}

cudnnDataType_t sixteen_bit(DType t) {
  if (t == kBFloat16) return CUDNN_DATA_BFLOAT16;
  if (t == kFloat16) return CUDNN_DATA_HALF;
  return CUDNN_DATA_FLOAT;  // not taken: the caller checks first
}

bool aligned(const Tensor& x) {
  const int64_t elem = static_cast<int64_t>(dtype_size(x.dtype()));
  return reinterpret_cast<uintptr_t>(x.raw_data()) % 16 == 0 && x.stride(3) == 1 &&
         (x.stride(0) * elem) % 16 == 0 && (x.stride(1) * elem) % 16 == 0 && (x.stride(2) * elem) % 16 == 0;
}

// Whether a fused engine may take these tensors at all: 16-bit floats, head
// sizes up to 128 in steps of 8, rows of 16-byte aligned vectors, a causal
// mask only when queries and keys are one sequence (cuDNN's mask is aligned
// top-left, the composite path's bottom-right: the same when T == S).
bool eligible(const Tensor& q, const Tensor& k, bool causal, std::initializer_list<const Tensor*> all) {
  if (q.dtype() != kBFloat16 && q.dtype() != kFloat16) return false;
  const int64_t d = q.size(3);
  if (d % 8 != 0 || d > 128 || (causal && q.size(2) != k.size(2))) return false;
  for (const Tensor* x : all)
    if (!aligned(*x)) return false;
  return q.numel() > 0 && k.numel() > 0;
}

Tensor workspace(int64_t bytes, int device) {
  if (bytes <= 0) return Tensor();
  return detail::empty_tensor({bytes}, kUInt8, Device(DeviceType::CUDA, device));
}

// Executes `plan` on the device's current stream; cuDNN's status (a searched
// candidate may refuse these operands after all).
cudnnStatus_t run(const Plan& plan, int device, const std::vector<int64_t>& uids, const std::vector<void*>& ptrs) {
  Tensor ws = workspace(plan.workspace, device);
  void* wp = ws.defined() ? ws.raw_data() : nullptr;
  BackendDesc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, static_cast<int64_t>(uids.size()), uids.data());
  pack.set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, static_cast<int64_t>(ptrs.size()), ptrs.data());
  pack.set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &wp);
  pack.finalize();
  const cudnnStatus_t st = cudnnBackendExecute(cudnn_handle(device), plan.desc.get(), pack.get());
  if (st != CUDNN_STATUS_SUCCESS) (void)cudaGetLastError();  // a refused launch must not poison later error checks
  return st;
}

}  // namespace

bool heuristic_attention_plans() { return search_switch.heuristic() || deterministic(); }

void set_heuristic_attention_plans(bool on) { search_switch.set_heuristic(on); }

int64_t attention_searches_run() { return searches_run.load(std::memory_order_relaxed); }

std::string fused_attention_refusal() {
  PlanCache& c = plan_cache();
  std::lock_guard<std::mutex> lock(c.mu);
  return c.refusal;
}

bool attention_fused_forward(const Tensor& q, const Tensor& k, const Tensor& v, double scale, bool causal,
                             const Tensor& out, const Tensor& stats) {
  if (!eligible(q, k, causal, {&q, &k, &v, &out})) return false;
  Problem p{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), sixteen_bit(q.dtype()), causal, false,
            strides_of(q), strides_of(k), strides_of(v), strides_of(out), {}, {}, {}, {}};
  const int device = q.device().index;
  CudaDeviceGuard guard(device);
  float sc = static_cast<float>(scale), neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<int64_t> uids{kUidQ, kUidK, kUidV, kUidO, kUidStats, kUidScale};
  std::vector<void*> ptrs{q.raw_data(), k.raw_data(), v.raw_data(), out.raw_data(), stats.raw_data(), &sc};
  if (causal) {
    uids.push_back(kUidNegInf);
    ptrs.push_back(&neg_inf);
  }
  const RunPlan run_plan = [&](const Plan& plan) { return run(plan, device, uids, ptrs); };
  std::shared_ptr<Plan> plan = plan_for(p, device, run_plan);
  if (!plan) return false;
  CHORUS_CUDNN_CHECK(run_plan(*plan));  // the chosen plan: its refusal is an error
  return true;
}

bool attention_fused_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& stats, double scale, bool causal, const Tensor& dq,
                              const Tensor& dk, const Tensor& dv) {
  if (!eligible(q, k, causal, {&dout, &q, &k, &v, &out, &dq, &dk, &dv})) return false;
  Problem p{q.size(0),      q.size(1),      q.size(2),       k.size(2),      q.size(3),
            sixteen_bit(q.dtype()), causal, true, strides_of(q), strides_of(k),
            strides_of(v),  strides_of(out), strides_of(dout), strides_of(dq), strides_of(dk), strides_of(dv)};
  const int device = q.device().index;
  CudaDeviceGuard guard(device);
  const Device dev = q.device();
  Tensor softmax_sum = detail::empty_tensor({p.b, p.h, p.t}, kFloat32, dev);
  Tensor dq_accum = detail::empty_tensor({p.b, p.h, p.t, p.d}, kFloat32, dev);
  float sc = static_cast<float>(scale), one = 1.0f, neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<int64_t> uids{kUidQ,  kUidK,  kUidV,  kUidO,  kUidDO,          kUidStats,   kUidDQ,
                            kUidDK, kUidDV, kUidScale, kUidOne, kUidSoftmaxSum, kUidDQAccum};
  std::vector<void*> ptrs{q.raw_data(),  k.raw_data(),  v.raw_data(),
                          out.raw_data(), dout.raw_data(), stats.raw_data(), dq.raw_data(), dk.raw_data(),
                          dv.raw_data(), &sc, &one, softmax_sum.raw_data(), dq_accum.raw_data()};
  if (causal) {
    uids.push_back(kUidNegInf);
    ptrs.push_back(&neg_inf);
  }
  const RunPlan run_plan = [&](const Plan& plan) {
    // cuDNN before 9.6 expects the accumulator zeroed by its caller: before
    // every run, the search's timed ones included.
    if (cudnnGetVersion() < 90600)
      CHORUS_CUDA_CHECK(
          cudaMemsetAsync(dq_accum.raw_data(), 0, dq_accum.numel() * sizeof(float), current_stream(device)));
    return run(plan, device, uids, ptrs);
  };
  std::shared_ptr<Plan> plan = plan_for(p, device, run_plan);
  if (!plan) return false;
  CHORUS_CUDNN_CHECK(run_plan(*plan));  // the chosen plan: its refusal is an error
  return true;
}

}  // namespace chorus::cuda

CHORUS_CUDNN_LEGACY_END
