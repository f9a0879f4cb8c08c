// The copy-engine all-reduce (Note [Copy-engine all-reduce] in
// peer_all_reduce.h).
#include "chorus/cuda/kernels/peer_all_reduce.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>

#include "chorus/core/error.h"
#include "chorus/cuda/runtime/context.h"
#include "chorus/cuda/kernels/dtype_dispatch.cuh"

namespace chorus::cuda {

namespace {

constexpr int kMaxDevices = 16;
constexpr size_t kAlignBytes = 16;  // chunk boundaries: whole 16-byte vectors

struct Sources {
  const void* p[kMaxDevices];
  int n;
};

// dst[k] = src[0][k] + src[1][k] + ... in that order, accumulated in float
// and rounded once. V elements at a time (V * sizeof(T) == 16, every pointer
// 16-byte aligned), or one at a time (V == 1).
// (dst is one of the sources: no __restrict__.)
template <typename T, int V>
__global__ void sum_chunks(Sources s, T* dst, int64_t n) {
  struct alignas(sizeof(T) * V) Vec { T e[V]; };
  const int64_t nv = n / V;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < nv; i += stride) {
    float acc[V];
#pragma unroll
    for (int v = 0; v < V; ++v) acc[v] = 0.f;
    for (int r = 0; r < s.n; ++r) {
      const Vec x = static_cast<const Vec*>(s.p[r])[i];
#pragma unroll
      for (int v = 0; v < V; ++v) acc[v] += convert<float>(x.e[v]);
    }
    Vec out;
#pragma unroll
    for (int v = 0; v < V; ++v) out.e[v] = convert<T>(acc[v]);
    reinterpret_cast<Vec*>(dst)[i] = out;
  }
  for (int64_t k = nv * V + int64_t{blockIdx.x} * blockDim.x + threadIdx.x; k < n; k += stride) {
    float acc = 0.f;
    for (int r = 0; r < s.n; ++r) acc += convert<float>(static_cast<const T*>(s.p[r])[k]);
    dst[k] = convert<T>(acc);
  }
}

struct PerDevice {
  cudaStream_t stream = nullptr;
  cudaEvent_t done = nullptr;     // stream -> a current stream, recorded at each join
  std::set<int> partners;         // the devices of every call with this one
};

struct State {
  std::mutex mu;
  std::map<int, PerDevice> devices;
};

// Leaked on purpose, as nccl.cpp's: a tensor freed at exit may still name a
// stream, and destroying streams then could touch an unloading runtime.
State& state() {
  static auto* s = new State;
  return *s;
}

PerDevice& per_device(State& st, int d) {
  PerDevice& pd = st.devices[d];
  if (!pd.stream) {
    CudaDeviceGuard guard(d);
    int least = 0, greatest = 0;
    CHORUS_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    PerDevice made;
    // The sum kernels are short and on the critical path of the bucket; the
    // copies do not use SMs, so priority only affects the sums.
    CHORUS_CUDA_CHECK(cudaStreamCreateWithPriority(&made.stream, cudaStreamNonBlocking, greatest));
    CHORUS_CUDA_CHECK(cudaEventCreateWithFlags(&made.done, cudaEventDisableTiming));
    pd = made;
  }
  return pd;
}

size_t chunk_elems(size_t count, size_t n, size_t elem) {
  const size_t align = kAlignBytes / elem;
  const size_t c = (count + n - 1) / n;
  return (c + align - 1) / align * align;
}

template <typename T>
void launch_sum(const Sources& s, T* dst, int64_t n, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  bool aligned = reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  for (int r = 0; r < s.n; ++r) aligned = aligned && reinterpret_cast<uintptr_t>(s.p[r]) % 16 == 0;
  const int64_t units = aligned ? n / V : n;
  const int threads = 256;
  const int blocks = static_cast<int>(std::clamp<int64_t>((units + threads - 1) / threads, 1, 264));
  if (aligned) sum_chunks<T, V><<<blocks, threads, 0, stream>>>(s, dst, n);
  else sum_chunks<T, 1><<<blocks, threads, 0, stream>>>(s, dst, n);
  CHORUS_CUDA_LAUNCH_CHECK();
}

}  // namespace

bool peer_all_reduce_supported(const std::vector<int>& devices, DType dtype) {
  if (devices.size() < 2 || devices.size() > static_cast<size_t>(kMaxDevices)) return false;
  if (dtype != DType::Float32 && dtype != DType::BFloat16 && dtype != DType::Float16) return false;
  for (int a : devices)
    for (int b : devices)
      if (a != b && !peer_access_enabled(a, b)) return false;
  return true;
}

size_t peer_all_reduce_scratch(size_t count, size_t n, DType dtype) {
  return n < 2 ? 0 : (n - 1) * chunk_elems(count, n, dtype_size(dtype));
}

void peer_all_reduce_wait(const std::vector<int>& devices, const std::vector<void*>& ready) {
  CHORUS_ASSERT(ready.size() == devices.size());
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  int cur_dev = 0;
  CHORUS_CUDA_CHECK(cudaGetDevice(&cur_dev));
  CudaDeviceGuard restore(cur_dev);
  for (int d : devices) {
    PerDevice& pd = per_device(st, d);
    CHORUS_CUDA_CHECK(cudaSetDevice(d));
    // Device d reads every buffer's chunk d: it starts once all are written.
    for (void* e : ready) CHORUS_CUDA_CHECK(cudaStreamWaitEvent(pd.stream, static_cast<cudaEvent_t>(e), 0));
    pd.partners.insert(devices.begin(), devices.end());
  }
}

void peer_all_reduce_sum(const std::vector<int>& devices, const std::vector<void*>& bufs,
                         const std::vector<void*>& scratch, size_t count, DType dtype) {
  const size_t n = devices.size();
  CHORUS_ASSERT(bufs.size() == n && scratch.size() == n && n <= kMaxDevices);
  if (n < 2 || count == 0) return;
  const size_t elem = dtype_size(dtype), c = chunk_elems(count, n, elem);
  auto chunk_len = [&](size_t i) { return i * c >= count ? size_t{0} : std::min(c, count - i * c); };
  auto at = [&](void* base, size_t elems) { return static_cast<char*>(base) + elems * elem; };

  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  int cur_dev = 0;
  CHORUS_CUDA_CHECK(cudaGetDevice(&cur_dev));
  CudaDeviceGuard restore(cur_dev);
  for (size_t i = 0; i < n; ++i) {
    const size_t len = chunk_len(i);
    if (len == 0) continue;
    CHORUS_CUDA_CHECK(cudaSetDevice(devices[i]));
    cudaStream_t s = per_device(st, devices[i]).stream;
    // 1. reduce-scatter: the other devices' chunk i, by the copy engines.
    Sources src{};
    src.n = static_cast<int>(n);
    size_t slot = 0;
    for (size_t j = 0; j < n; ++j) {
      if (j == i) {
        src.p[j] = at(bufs[i], i * c);
        continue;
      }
      void* tmp = at(scratch[i], slot++ * c);
      CHORUS_CUDA_CHECK(cudaMemcpyAsync(tmp, at(bufs[j], i * c), len * elem, cudaMemcpyDefault, s));
      src.p[j] = tmp;
    }
    dispatch_float(dtype, "peer_all_reduce", [&]<typename T>() {
      launch_sum<T>(src, reinterpret_cast<T*>(at(bufs[i], i * c)), static_cast<int64_t>(len), s);
    });
    // 2. all-gather: the summed chunk i into every other device's buffer.
    for (size_t j = 0; j < n; ++j)
      if (j != i) CHORUS_CUDA_CHECK(cudaMemcpyAsync(at(bufs[j], i * c), at(bufs[i], i * c), len * elem,
                                                    cudaMemcpyDefault, s));
  }
}

void peer_exchange_wait(int a, int b, void* ready_a, void* ready_b) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  int cur_dev = 0;
  CHORUS_CUDA_CHECK(cudaGetDevice(&cur_dev));
  CudaDeviceGuard restore(cur_dev);
  // Each side waits only for the other's gradients: the copy into its own
  // fresh buffers reads nothing of its own device.
  auto wait = [&](int dev, void* other_ready) {
    PerDevice& pd = per_device(st, dev);
    CHORUS_CUDA_CHECK(cudaSetDevice(dev));
    CHORUS_CUDA_CHECK(cudaStreamWaitEvent(pd.stream, static_cast<cudaEvent_t>(other_ready), 0));
    pd.partners.insert({a, b});
  };
  wait(a, ready_b);
  wait(b, ready_a);
}

void peer_exchange_copy(int a, int b, const std::vector<void*>& srcs_a, const std::vector<void*>& srcs_b,
                        const std::vector<void*>& dsts_a, const std::vector<void*>& dsts_b,
                        const std::vector<size_t>& bytes) {
  const size_t n = bytes.size();
  CHORUS_ASSERT(srcs_a.size() == n && srcs_b.size() == n && dsts_a.size() == n && dsts_b.size() == n);
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  int cur_dev = 0;
  CHORUS_CUDA_CHECK(cudaGetDevice(&cur_dev));
  CudaDeviceGuard restore(cur_dev);
  auto pull = [&](int dev, const std::vector<void*>& dsts, const std::vector<void*>& srcs) {
    PerDevice& pd = per_device(st, dev);
    CHORUS_CUDA_CHECK(cudaSetDevice(dev));
    for (size_t t = 0; t < n; ++t)
      if (bytes[t] > 0) CHORUS_CUDA_CHECK(cudaMemcpyAsync(dsts[t], srcs[t], bytes[t], cudaMemcpyDefault, pd.stream));
  };
  pull(a, dsts_a, srcs_b);
  pull(b, dsts_b, srcs_a);
}

void peer_join(int device) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  auto it = st.devices.find(device);
  if (it == st.devices.end()) return;
  cudaStream_t cur = current_stream(device);
  int cur_dev = 0;
  CHORUS_CUDA_CHECK(cudaGetDevice(&cur_dev));
  CudaDeviceGuard restore(cur_dev);
  // Every partner's stream wrote into this device's buffers. `done` may be
  // re-recorded by the next join: a wait captures the event's state.
  for (int p : it->second.partners) {
    PerDevice& pd = st.devices.at(p);
    if (!same_capture(cur, pd.stream)) continue;  // nothing of it in this capture (or it is in one)
    CHORUS_CUDA_CHECK(cudaSetDevice(p));
    CHORUS_CUDA_CHECK(cudaEventRecord(pd.done, pd.stream));
    CHORUS_CUDA_CHECK(cudaSetDevice(device));
    CHORUS_CUDA_CHECK(cudaStreamWaitEvent(cur, pd.done, 0));
  }
}

void* peer_stream(int device) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  return per_device(st, device).stream;
}

}  // namespace chorus::cuda
