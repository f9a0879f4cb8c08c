// Fused optimizer updates of the CUDA kernel set: one pass over parameter,
// gradient and state, in float32, with PyTorch's update rules.
#include <cmath>
#include <cstdint>

#include "chorus/cuda/runtime/context.h"
#include "chorus/cuda/kernels/dtype_dispatch.cuh"
#include "chorus/cuda/kernels/kernels.h"
#include "chorus/cuda/kernels/tensor_iter.cuh"

namespace chorus::cuda {

namespace {

// Scalars are rounded to float once on the host, as cpu/optim_kernels.cpp
// does, so both devices run the same float arithmetic.
struct SgdParams {
  float lr, momentum, one_minus_dampening, weight_decay;
  bool nesterov, first_step, has_momentum;
  // Note [Optimizer scalars on the device]: when set, lr is read from here.
  const float* scalars = nullptr;
};

// Element i of one SGD update:
// g = grad + wd * param
// momentum: buf = first_step ? g : momentum * buf + (1 - dampening) * g
//           g = nesterov ? g + momentum * buf : buf
// param -= lr * g
// On values: the multi-tensor kernel applies it to the lanes of 16-byte packs.
__device__ __forceinline__ void sgd_value(float& param, float grad, float& buf, const SgdParams& p) {
  float g = grad + p.weight_decay * param;
  if (p.has_momentum) {
    const float b = p.first_step ? g : p.momentum * buf + p.one_minus_dampening * g;
    buf = b;
    g = p.nesterov ? g + p.momentum * b : b;
  }
  param -= p.lr * g;
}

__device__ __forceinline__ void sgd_element(float* param, const float* grad, float* buf, int64_t i,
                                            const SgdParams& p) {
  float b = p.has_momentum ? buf[i] : 0.f;
  sgd_value(param[i], grad[i], b, p);
  if (p.has_momentum) buf[i] = b;
}

__global__ void sgd_kernel(float* param, const float* grad, float* buf, int64_t n, SgdParams p) {
  for (int64_t i = global_thread_id(); i < n; i += grid_stride()) sgd_element(param, grad, buf, i, p);
}

struct AdamWParams {
  float decay;       // 1 - lr * wd
  float step_size;   // lr / (1 - beta1^step)
  float bias2_sqrt;  // sqrt(1 - beta2^step)
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps;
  // Note [Optimizer scalars on the device]: when set, decay, step_size and
  // bias2_sqrt are computed from [lr, step] read here, in double as the host
  // computes them.
  const float* scalars = nullptr;
  double beta1_d = 0, beta2_d = 0, weight_decay_d = 0;
  // Note [Clipping in the update] (optim/clip_grad.h): when set, every
  // gradient is multiplied by this one float as it is read; resolve() puts
  // it in grad_scale (1 otherwise, an exact multiplication).
  const float* grad_scale_ptr = nullptr;
  float grad_scale = 1.f;
};

__device__ __forceinline__ AdamWParams resolve(AdamWParams p) {
  if (p.scalars) {
    const double lr = p.scalars[0], step = p.scalars[1];  // float -> double, exactly
    const double bias1 = 1.0 - pow(p.beta1_d, step);
    const double bias2 = 1.0 - pow(p.beta2_d, step);
    p.decay = static_cast<float>(1.0 - lr * p.weight_decay_d);
    p.step_size = static_cast<float>(lr / bias1);
    p.bias2_sqrt = static_cast<float>(sqrt(bias2));
  }
  if (p.grad_scale_ptr) p.grad_scale = *p.grad_scale_ptr;
  return p;
}

__device__ __forceinline__ SgdParams resolve(SgdParams p) {
  if (p.scalars) p.lr = p.scalars[0];
  return p;
}

// PyTorch's AdamW:
//   param *= 1 - lr * wd
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   param -= lr / (1 - b1^step) * m / (sqrt(v) / sqrt(1 - b2^step) + eps)
// which is lr * m_hat / (sqrt(v_hat) + eps) with the bias corrections folded in.
__device__ __forceinline__ void adamw_value(float& param, float g, float& exp_avg, float& exp_avg_sq,
                                            const AdamWParams& p) {
  const float m = p.beta1 * exp_avg + p.one_minus_beta1 * g;
  const float v = p.beta2 * exp_avg_sq + p.one_minus_beta2 * g * g;
  exp_avg = m;
  exp_avg_sq = v;
  param = param * p.decay - p.step_size * m / (sqrtf(v) / p.bias2_sqrt + p.eps);
}

__device__ __forceinline__ void adamw_element(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                                              int64_t i, const AdamWParams& p) {
  adamw_value(param[i], grad[i], exp_avg[i], exp_avg_sq[i], p);
}

// Note [Optimizer packs]: the multi-tensor updates are bound by memory (SGD
// with momentum moves 20 bytes per parameter), and one float per load kept
// the H100 well below its bandwidth over WRN-28-10's 36.5M parameters
// (benchmarks journal, session 12). A tensor whose state pointers are all 16-byte aligned is
// updated a float4 pack per thread per iteration; a block's chunk starts at a
// multiple of kMultiChunk (a multiple of 4), and the chunk's last n % 4 elements,
// or a tensor not so aligned (a view into a bucket at an odd offset), go one
// float at a time.
__host__ __device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

__device__ __forceinline__ float& lane(float4& v, int j) { return (&v.x)[j]; }

__global__ void adamw_kernel(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                             int64_t n, AdamWParams p) {
  for (int64_t i = global_thread_id(); i < n; i += grid_stride()) adamw_element(param, grad, exp_avg, exp_avg_sq, i, p);
}

AdamWParams adamw_params(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step) {
  const double bias1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  return AdamWParams{static_cast<float>(1.0 - lr * weight_decay),
                     static_cast<float>(lr / bias1),
                     static_cast<float>(std::sqrt(bias2)),
                     static_cast<float>(beta1),
                     static_cast<float>(beta2),
                     static_cast<float>(1.0 - beta1),
                     static_cast<float>(1.0 - beta2),
                     static_cast<float>(eps)};
}

void check_state(const Tensor& param, const Tensor& t, const char* op, const char* what) {
  CHORUS_CHECK(t.dtype() == kFloat32 && t.is_contiguous() && t.device() == param.device() &&
                   t.numel() == param.numel(),
               op, ": ", what, " must be a contiguous float32 tensor of ", param.numel(),
               " elements on ", param.device().str(), ", got ", t.describe());
}

// Note [Optimizer scalars on the device]: the [lr, step] tensor, or nullptr.
const float* device_scalars(const Tensor& scalars, const Tensor& param, const char* op) {
  if (!scalars.defined()) return nullptr;
  CHORUS_CHECK(scalars.dtype() == kFloat32 && scalars.is_contiguous() && scalars.numel() == 2 &&
                   scalars.device() == param.device(),
               op, ": the device scalars must be a contiguous float32 [lr, step] on ", param.device().str(),
               ", got ", scalars.describe());
  return scalars.data<float>();
}

// addends: empty, or one per parameter (undefined where none), float32 and
// contiguous like the parameter (Note [Gradient sums in the update]).
void check_addend(const TensorList& addends, const TensorList& params, size_t i, const char* op) {
  CHORUS_CHECK(addends.empty() || addends.size() == params.size(), op, ": ", params.size(), " parameters but ",
               addends.size(), " addends");
  if (!addends.empty() && addends[i].defined()) check_state(params[i], addends[i], op, "the addend");
}

const float* addend_ptr(const TensorList& addends, size_t i) {
  return addends.empty() || !addends[i].defined() ? nullptr : addends[i].data<float>();
}

}  // namespace

void sgd_update(const Tensor& param, const Tensor& grad, const Tensor& momentum_buf, double lr,
                double momentum, double dampening, double weight_decay, bool nesterov,
                bool first_step) {
  CHORUS_CHECK(param.device().is_cuda(), "sgd_update: expected a CUDA parameter, got ",
               param.describe());
  check_state(param, param, "sgd_update", "the parameter");
  check_state(param, grad, "sgd_update", "the gradient");
  const bool has_momentum = momentum != 0.0;
  if (has_momentum) check_state(param, momentum_buf, "sgd_update", "the momentum buffer");
  const int64_t n = param.numel();
  if (n == 0) return;
  const int dev = param.device().index;
  CudaDeviceGuard guard(dev);
  const SgdParams p{static_cast<float>(lr), static_cast<float>(momentum),
                    static_cast<float>(1.0 - dampening), static_cast<float>(weight_decay),
                    nesterov, first_step, has_momentum};
  sgd_kernel<<<grid_for(n), kThreads, 0, current_stream(dev)>>>(
      param.data<float>(), grad.data<float>(),
      has_momentum ? momentum_buf.data<float>() : nullptr, n, p);
  CHORUS_CUDA_LAUNCH_CHECK();
}

namespace {

// Multi-tensor updates: one launch updates many parameters. The tensor table
// travels as a kernel argument (under CUDA's 4 KiB parameter limit) and names
// each tensor's first block (a block finds its tensor by a scan of the
// table), so a launch has as many blocks as its tensors have chunks of
// kMultiChunk: 8192 elements, about eight resident blocks an SM and several
// waves. Longer lists of tensors are split into several launches. 320 blocks
// of 32768 elements a launch (2.4 an SM) left a third of the SMs idle for
// the last third of each launch: WRN-28-10's SGD on an H100 (benchmarks
// journal, session 24), and gpt2's AdamW on an H200, 15 launches of 1.10 ms
// in all a step (session 42).
constexpr int64_t kMultiChunk = 8192;
constexpr int kSgdUnroll = 4;
constexpr int kSgdTensors = 64;
// AdamW's state is one pointer more a tensor.
constexpr int kAdamTensors = 56;

// The 16-bit copy an update also writes (Note [Autocast weight copies]).
enum CopyKind : uint8_t { kNoCopy = 0, kBf16Copy = 1, kF16Copy = 2 };

struct SgdTable {
  float* param[kSgdTensors];
  const float* grad[kSgdTensors];
  const float* addend[kSgdTensors];  // or nullptr (Note [Gradient sums in the update])
  float* buf[kSgdTensors];
  void* copy[kSgdTensors];
  int64_t n[kSgdTensors];
  int32_t first_block[kSgdTensors];  // the launch's first block on each tensor
  uint8_t packed[kSgdTensors];       // Note [Optimizer packs]
  uint8_t copy_kind[kSgdTensors];
  int32_t tensors;
};

__device__ __forceinline__ void write_copy(void* copy, uint8_t kind, int64_t i, float v) {
  if (kind == kBf16Copy) static_cast<bf16*>(copy)[i] = convert<bf16>(v);
  else if (kind == kF16Copy) static_cast<fp16*>(copy)[i] = convert<fp16>(v);
}

// Four lanes at once (8 bytes; the pack path needs the copy 8-byte aligned).
__device__ __forceinline__ void write_copy4(void* copy, uint8_t kind, int64_t i, const float4& v) {
  if (kind == kBf16Copy) {
    __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
    uint2 bits{*reinterpret_cast<uint32_t*>(&lo), *reinterpret_cast<uint32_t*>(&hi)};
    *reinterpret_cast<uint2*>(static_cast<bf16*>(copy) + i) = bits;
  } else if (kind == kF16Copy) {
    __half2 lo = __floats2half2_rn(v.x, v.y), hi = __floats2half2_rn(v.z, v.w);
    uint2 bits{*reinterpret_cast<uint32_t*>(&lo), *reinterpret_cast<uint32_t*>(&hi)};
    *reinterpret_cast<uint2*>(static_cast<fp16*>(copy) + i) = bits;
  }
}
static_assert(sizeof(SgdTable) + sizeof(SgdParams) < 4000, "kernel parameters too large");

// copies[i], when there is one, must be a contiguous 16-bit tensor of params[i]'s size on its device.
void check_copy(const TensorList& copies, const TensorList& params, size_t i, const char* op) {
  if (copies.empty() || !copies[i].defined()) return;
  CHORUS_CHECK((copies[i].dtype() == kBFloat16 || copies[i].dtype() == kFloat16) && copies[i].is_contiguous() &&
                   copies[i].device() == params[i].device() && copies[i].numel() == params[i].numel(),
               op, ": the copy of parameter ", i, " must be a contiguous bfloat16 or float16 tensor of ",
               params[i].numel(), " elements on ", params[i].device().str(), ", got ", copies[i].describe());
}

// The table entries of a parameter's copy (kNoCopy without one).
template <typename Table>
void put_copy(Table& table, int k, const TensorList& copies, size_t i) {
  const bool has_copy = !copies.empty() && copies[i].defined();
  table.copy[k] = has_copy ? copies[i].raw_data() : nullptr;
  table.copy_kind[k] = !has_copy ? kNoCopy : copies[i].dtype() == kBFloat16 ? kBf16Copy : kF16Copy;
}

// write_copy4's 8-byte stores need the copy 8-byte aligned for the pack path.
bool copy_packable(const void* copy) { return (reinterpret_cast<uintptr_t>(copy) & 7) == 0; }

// The launches of a multi-tensor update: params in order, up to max_tensors
// a launch, each non-empty tensor a block per chunk of kMultiChunk elements.
// put(k, i, first_block) fills table entry k with parameter i, which starts
// at block first_block of its launch; launch(tensors, blocks) runs a launch.
template <typename Put, typename Launch>
void multi_launches(const TensorList& params, int max_tensors, const char* op, Put&& put, Launch&& launch) {
  int tensors = 0;
  int64_t blocks = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t n = params[i].numel();
    if (n == 0) continue;
    const int64_t chunks = (n + kMultiChunk - 1) / kMultiChunk;
    CHORUS_CHECK(chunks <= (int64_t{1} << 30), op, ": parameter ", i, " has ", n,
                 " elements, more than one launch updates");
    // A launch's blocks stay well inside the grid's 2^31 - 1.
    if (tensors == max_tensors || blocks + chunks > (int64_t{1} << 30)) {
      launch(tensors, blocks);
      tensors = 0;
      blocks = 0;
    }
    put(tensors++, i, static_cast<int32_t>(blocks));
    blocks += chunks;
  }
  if (blocks > 0) launch(tensors, blocks);
}

// A gradient pack plus its addend's, when there is one (one float addition
// per lane: Note [Gradient sums in the update]).
__device__ __forceinline__ float4 add4(float4 g, const float* addend, int64_t begin, int64_t v) {
  if (addend) {
    const float4 a = reinterpret_cast<const float4*>(addend + begin)[v];
    g.x += a.x;
    g.y += a.y;
    g.z += a.z;
    g.w += a.w;
  }
  return g;
}

__global__ void sgd_multi_kernel(SgdTable t, SgdParams params) {
  const SgdParams p = resolve(params);
  int k = 0;
  while (k + 1 < t.tensors && t.first_block[k + 1] <= static_cast<int32_t>(blockIdx.x)) ++k;
  const int64_t begin = int64_t{static_cast<int32_t>(blockIdx.x) - t.first_block[k]} * kMultiChunk;
  const int64_t end = min(t.n[k], begin + kMultiChunk);
  float* param = t.param[k];
  const float* grad = t.grad[k];
  const float* addend = t.addend[k];
  float* buf = t.buf[k];
  void* copy = t.copy[k];
  const uint8_t kind = t.copy_kind[k];
  int64_t tail = begin;
  if (t.packed[k]) {  // Note [Optimizer packs]
    const int64_t packs = (end - begin) / 4;
    auto* p4 = reinterpret_cast<float4*>(param + begin);
    const auto* g4 = reinterpret_cast<const float4*>(grad + begin);
    auto* b4 = reinterpret_cast<float4*>(buf + begin);
    // kSgdUnroll packs a thread, all loaded before any is used: a launch has
    // ~2 blocks an SM, and one pack's three loads in flight a thread left the
    // update short of the H100's bandwidth; the graphed WRN-28-10 bf16 step
    // got faster with it (benchmarks journal, session 23).
    int64_t v = threadIdx.x;
    for (; v + (kSgdUnroll - 1) * blockDim.x < packs; v += kSgdUnroll * blockDim.x) {
      float4 pv[kSgdUnroll], gv[kSgdUnroll], bv[kSgdUnroll];
#pragma unroll
      for (int u = 0; u < kSgdUnroll; ++u) {
        const int64_t w = v + u * blockDim.x;
        pv[u] = p4[w];
        gv[u] = add4(g4[w], addend, begin, w);
        bv[u] = p.has_momentum ? b4[w] : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < kSgdUnroll; ++u) {
        const int64_t w = v + u * blockDim.x;
#pragma unroll
        for (int j = 0; j < 4; ++j) sgd_value(lane(pv[u], j), (&gv[u].x)[j], lane(bv[u], j), p);
        p4[w] = pv[u];
        if (p.has_momentum) b4[w] = bv[u];
        write_copy4(copy, kind, begin + 4 * w, pv[u]);
      }
    }
    for (; v < packs; v += blockDim.x) {
      float4 pv = p4[v];
      const float4 gv = add4(g4[v], addend, begin, v);
      float4 bv = p.has_momentum ? b4[v] : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int j = 0; j < 4; ++j) sgd_value(lane(pv, j), (&gv.x)[j], lane(bv, j), p);
      p4[v] = pv;
      if (p.has_momentum) b4[v] = bv;
      write_copy4(copy, kind, begin + 4 * v, pv);
    }
    tail = begin + packs * 4;
  }
  for (int64_t i = tail + threadIdx.x; i < end; i += blockDim.x) {
    float b = p.has_momentum ? buf[i] : 0.f;
    sgd_value(param[i], addend ? grad[i] + addend[i] : grad[i], b, p);
    if (p.has_momentum) buf[i] = b;
    write_copy(copy, kind, i, param[i]);
  }
}

}  // namespace

void sgd_update_multi(const TensorList& params, const TensorList& grads,
                      const TensorList& momentum_bufs, double lr, double momentum,
                      double dampening, double weight_decay, bool nesterov, bool first_step,
                      const Tensor& scalars, const TensorList& copies, const TensorList& addends) {
  CHORUS_CHECK(grads.size() == params.size() && momentum_bufs.size() == params.size(),
               "sgd_update_multi: ", params.size(), " parameters but ", grads.size(),
               " gradients and ", momentum_bufs.size(), " momentum buffers");
  CHORUS_CHECK(copies.empty() || copies.size() == params.size(), "sgd_update_multi: ", params.size(),
               " parameters but ", copies.size(), " copies");
  if (params.empty()) return;
  const int dev = params[0].device().index;
  const bool has_momentum = momentum != 0.0;
  for (size_t i = 0; i < params.size(); ++i) {
    CHORUS_CHECK(params[i].device() == params[0].device(), "sgd_update_multi: parameter ", i,
                 " is on ", params[i].device().str(), ", parameter 0 on ",
                 params[0].device().str());
    check_state(params[i], params[i], "sgd_update_multi", "the parameter");
    check_state(params[i], grads[i], "sgd_update_multi", "the gradient");
    check_addend(addends, params, i, "sgd_update_multi");
    if (has_momentum) check_state(params[i], momentum_bufs[i], "sgd_update_multi", "the momentum buffer");
    check_copy(copies, params, i, "sgd_update_multi");
  }
  CudaDeviceGuard guard(dev);
  SgdParams p{static_cast<float>(lr), static_cast<float>(momentum),
              static_cast<float>(1.0 - dampening), static_cast<float>(weight_decay),
              nesterov, first_step, has_momentum};
  p.scalars = device_scalars(scalars, params[0], "sgd_update_multi");
  SgdTable table{};
  multi_launches(
      params, kSgdTensors, "sgd_update_multi",
      [&](int k, size_t i, int32_t first_block) {
        table.first_block[k] = first_block;
        table.param[k] = params[i].data<float>();
        table.grad[k] = grads[i].data<float>();
        table.addend[k] = addend_ptr(addends, i);
        table.buf[k] = has_momentum ? momentum_bufs[i].data<float>() : nullptr;
        table.n[k] = params[i].numel();
        put_copy(table, k, copies, i);
        table.packed[k] = aligned16(table.param[k]) && aligned16(table.grad[k]) && aligned16(table.addend[k]) &&
                          (!has_momentum || aligned16(table.buf[k])) && copy_packable(table.copy[k]);
      },
      [&](int tensors, int64_t blocks) {
        table.tensors = tensors;
        sgd_multi_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, current_stream(dev)>>>(table, p);
        CHORUS_CUDA_LAUNCH_CHECK();
      });
}

void adamw_update(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                  const Tensor& exp_avg_sq, double lr, double beta1, double beta2, double eps,
                  double weight_decay, int64_t step) {
  CHORUS_CHECK(param.device().is_cuda(), "adamw_update: expected a CUDA parameter, got ",
               param.describe());
  CHORUS_CHECK(step >= 1, "adamw_update: step counts from 1, got ", step);
  check_state(param, param, "adamw_update", "the parameter");
  check_state(param, grad, "adamw_update", "the gradient");
  check_state(param, exp_avg, "adamw_update", "exp_avg");
  check_state(param, exp_avg_sq, "adamw_update", "exp_avg_sq");
  const int64_t n = param.numel();
  if (n == 0) return;
  const int dev = param.device().index;
  CudaDeviceGuard guard(dev);
  const AdamWParams p = adamw_params(lr, beta1, beta2, eps, weight_decay, step);
  adamw_kernel<<<grid_for(n), kThreads, 0, current_stream(dev)>>>(
      param.data<float>(), grad.data<float>(), exp_avg.data<float>(), exp_avg_sq.data<float>(), n,
      p);
  CHORUS_CUDA_LAUNCH_CHECK();
}

namespace {

// Multi-tensor AdamW, as sgd_multi_kernel: the table of tensors, each with
// its first block, is the kernel's argument.
struct AdamTable {
  float* param[kAdamTensors];
  const float* grad[kAdamTensors];
  const float* addend[kAdamTensors];  // or nullptr
  float* exp_avg[kAdamTensors];
  float* exp_avg_sq[kAdamTensors];
  void* copy[kAdamTensors];  // Note [Autocast weight copies]: or nullptr
  int64_t n[kAdamTensors];
  int32_t first_block[kAdamTensors];  // the launch's first block on each tensor
  uint8_t packed[kAdamTensors];       // Note [Optimizer packs]
  uint8_t copy_kind[kAdamTensors];
  int32_t tensors;
};
static_assert(sizeof(AdamTable) + sizeof(AdamWParams) < 4000, "kernel parameters too large");

// Two packs a thread loaded before either is used (8 loads of 16 bytes in
// flight), as kSgdUnroll does for SGD.
constexpr int kAdamUnroll = 2;

__global__ void adamw_multi_kernel(AdamTable t, AdamWParams params) {
  const AdamWParams p = resolve(params);
  int k = 0;
  while (k + 1 < t.tensors && t.first_block[k + 1] <= static_cast<int32_t>(blockIdx.x)) ++k;
  const int64_t begin = int64_t{static_cast<int32_t>(blockIdx.x) - t.first_block[k]} * kMultiChunk;
  const int64_t end = min(t.n[k], begin + kMultiChunk);
  const float* addend = t.addend[k];
  void* copy = t.copy[k];
  const uint8_t kind = t.copy_kind[k];
  int64_t tail = begin;
  if (t.packed[k]) {  // Note [Optimizer packs]
    const int64_t packs = (end - begin) / 4;
    auto* p4 = reinterpret_cast<float4*>(t.param[k] + begin);
    const auto* g4 = reinterpret_cast<const float4*>(t.grad[k] + begin);
    auto* m4 = reinterpret_cast<float4*>(t.exp_avg[k] + begin);
    auto* v4 = reinterpret_cast<float4*>(t.exp_avg_sq[k] + begin);
    int64_t v = threadIdx.x;
    for (; v + (kAdamUnroll - 1) * blockDim.x < packs; v += kAdamUnroll * blockDim.x) {
      float4 pv[kAdamUnroll], gv[kAdamUnroll], mv[kAdamUnroll], vv[kAdamUnroll];
#pragma unroll
      for (int u = 0; u < kAdamUnroll; ++u) {
        const int64_t w = v + u * blockDim.x;
        pv[u] = p4[w];
        gv[u] = add4(g4[w], addend, begin, w);
        mv[u] = m4[w];
        vv[u] = v4[w];
      }
#pragma unroll
      for (int u = 0; u < kAdamUnroll; ++u) {
        const int64_t w = v + u * blockDim.x;
#pragma unroll
        for (int j = 0; j < 4; ++j)
          adamw_value(lane(pv[u], j), (&gv[u].x)[j] * p.grad_scale, lane(mv[u], j), lane(vv[u], j), p);
        p4[w] = pv[u];
        m4[w] = mv[u];
        v4[w] = vv[u];
        write_copy4(copy, kind, begin + 4 * w, pv[u]);
      }
    }
    for (; v < packs; v += blockDim.x) {
      float4 pv = p4[v], mv = m4[v], vv = v4[v];
      const float4 gv = add4(g4[v], addend, begin, v);
#pragma unroll
      for (int j = 0; j < 4; ++j) adamw_value(lane(pv, j), (&gv.x)[j] * p.grad_scale, lane(mv, j), lane(vv, j), p);
      p4[v] = pv;
      m4[v] = mv;
      v4[v] = vv;
      write_copy4(copy, kind, begin + 4 * v, pv);
    }
    tail = begin + packs * 4;
  }
  for (int64_t i = tail + threadIdx.x; i < end; i += blockDim.x) {
    adamw_value(t.param[k][i], (addend ? t.grad[k][i] + addend[i] : t.grad[k][i]) * p.grad_scale, t.exp_avg[k][i],
                t.exp_avg_sq[k][i], p);
    write_copy(copy, kind, i, t.param[k][i]);
  }
}

}  // namespace

void adamw_update_multi(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
                        const TensorList& exp_avg_sqs, double lr, double beta1, double beta2, double eps,
                        double weight_decay, int64_t step, const Tensor& scalars, const TensorList& addends,
                        const Tensor& grad_scale, const TensorList& copies) {
  CHORUS_CHECK(grads.size() == params.size() && exp_avgs.size() == params.size() &&
                   exp_avg_sqs.size() == params.size(),
               "adamw_update_multi: ", params.size(), " parameters but ", grads.size(), " gradients, ",
               exp_avgs.size(), " exp_avg and ", exp_avg_sqs.size(), " exp_avg_sq");
  CHORUS_CHECK(copies.empty() || copies.size() == params.size(), "adamw_update_multi: ", params.size(),
               " parameters but ", copies.size(), " copies");
  CHORUS_CHECK(step >= 1, "adamw_update_multi: step counts from 1, got ", step);
  if (params.empty()) return;
  const int dev = params[0].device().index;
  for (size_t i = 0; i < params.size(); ++i) {
    CHORUS_CHECK(params[i].device() == params[0].device(), "adamw_update_multi: parameter ", i, " is on ",
                 params[i].device().str(), ", parameter 0 on ", params[0].device().str());
    check_state(params[i], params[i], "adamw_update_multi", "the parameter");
    check_state(params[i], grads[i], "adamw_update_multi", "the gradient");
    check_addend(addends, params, i, "adamw_update_multi");
    check_state(params[i], exp_avgs[i], "adamw_update_multi", "exp_avg");
    check_state(params[i], exp_avg_sqs[i], "adamw_update_multi", "exp_avg_sq");
    check_copy(copies, params, i, "adamw_update_multi");
  }
  CudaDeviceGuard guard(dev);
  AdamWParams p = adamw_params(lr, beta1, beta2, eps, weight_decay, step);
  p.scalars = device_scalars(scalars, params[0], "adamw_update_multi");
  p.beta1_d = beta1;
  p.beta2_d = beta2;
  p.weight_decay_d = weight_decay;
  if (grad_scale.defined()) {
    CHORUS_CHECK(grad_scale.dtype() == kFloat32 && grad_scale.numel() == 1 && grad_scale.device() == params[0].device(),
                 "adamw_update_multi: the gradient scale must be one float32 element on ", params[0].device().str(),
                 ", got ", grad_scale.describe());
    p.grad_scale_ptr = grad_scale.data<float>();
  }
  AdamTable table{};
  multi_launches(
      params, kAdamTensors, "adamw_update_multi",
      [&](int k, size_t i, int32_t first_block) {
        table.first_block[k] = first_block;
        table.param[k] = params[i].data<float>();
        table.grad[k] = grads[i].data<float>();
        table.addend[k] = addend_ptr(addends, i);
        table.exp_avg[k] = exp_avgs[i].data<float>();
        table.exp_avg_sq[k] = exp_avg_sqs[i].data<float>();
        table.n[k] = params[i].numel();
        put_copy(table, k, copies, i);
        table.packed[k] = aligned16(table.param[k]) && aligned16(table.grad[k]) && aligned16(table.addend[k]) &&
                          aligned16(table.exp_avg[k]) && aligned16(table.exp_avg_sq[k]) &&
                          copy_packable(table.copy[k]);
      },
      [&](int tensors, int64_t blocks) {
        table.tensors = tensors;
        adamw_multi_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, current_stream(dev)>>>(table, p);
        CHORUS_CUDA_LAUNCH_CHECK();
      });
}

}  // namespace chorus::cuda
