// How long a CUDA graph's replay takes beyond its kernels, for the shapes a
// DataParallel step can take (Note [One graph per device] in
// parallel/graphed_step.h): one device; two devices in one graph (a fork at
// the start, a join at the end, optionally a cross-device edge in the
// middle, as an input scatter or a loss gather makes); one graph per device,
// with and without an eager cross-device event wait per step.
//
//   graph_launch [kernels per device = 400] [kernel us = 20] [replays = 200]
//
// Prints, per case, the time per replay and the overhead against the chain
// of kernels alone (kernels x kernel time). Needs two GPUs for the 2-device
// cases (skipped otherwise).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#define CK(x)                                                                          \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

// Spins for `ns` nanoseconds of the global timer (not SM cycles: the
// kernels last as long on a GPU whose clock runs lower).
__device__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// The first and the last kernel of a chain stamp when a replay began and
// ended (slot = the replays so far), so the gap between replays can be told
// from the time inside them.
struct Stamps {
  unsigned long long* begin;
  unsigned long long* end;
  int* count;
};
__global__ void stamp_begin(Stamps s, long long ns) {
  const unsigned long long t = now_ns();
  s.begin[*s.count % 4096] = t;
  while (now_ns() - t < static_cast<unsigned long long>(ns)) {
  }
}
__global__ void stamp_end(Stamps s, long long ns) {
  const unsigned long long t = now_ns();
  while (now_ns() - t < static_cast<unsigned long long>(ns)) {
  }
  s.end[*s.count % 4096] = now_ns();
  ++*s.count;
}
// A copy by the SMs (across NVLink through peer access) instead of a copy engine.
__global__ void copy_kernel(const float4* __restrict__ src, float4* __restrict__ dst, size_t n) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) dst[i] = src[i];
}
__global__ void spin(long long ns) {
  const unsigned long long t = now_ns();
  while (now_ns() - t < static_cast<unsigned long long>(ns)) {
  }
}

namespace {

int g_kernels = 400, g_replays = 200;
long long g_cycles = 0;

Stamps g_stamps[2];

Stamps& stamps_of(cudaStream_t s) {
  int dev = 0;
  CK(cudaGetDevice(&dev));
  (void)s;
  return g_stamps[dev];
}

void chain(cudaStream_t s, int n) {
  Stamps& st = stamps_of(s);
  stamp_begin<<<1, 1, 0, s>>>(st, g_cycles);
  for (int i = 1; i + 1 < n; ++i) spin<<<1, 32, 0, s>>>(g_cycles);
  stamp_end<<<1, 1, 0, s>>>(st, g_cycles);
}

// Mean gap between one replay's last kernel and the next one's first, per device.
void print_gaps(int ndev) {
  for (int d = 0; d < ndev; ++d) {
    CK(cudaSetDevice(d));
    CK(cudaDeviceSynchronize());
    int count = 0;
    CK(cudaMemcpy(&count, g_stamps[d].count, sizeof(int), cudaMemcpyDeviceToHost));
    std::vector<unsigned long long> b(4096), e(4096);
    CK(cudaMemcpy(b.data(), g_stamps[d].begin, 4096 * 8, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(e.data(), g_stamps[d].end, 4096 * 8, cudaMemcpyDeviceToHost));
    const int n = std::min(count, 4096), from = std::max(1, n - g_replays + 1);
    double gap = 0, body = 0;
    int k = 0;
    for (int i = from; i < n; ++i, ++k) {
      gap += static_cast<double>(b[i] - e[i - 1]);
      body += static_cast<double>(e[i] - b[i]);
    }
    if (k) std::printf("graph_launch     device %d: %.1f us between replays, %.1f us inside one\n", d, gap / k / 1e3, body / k / 1e3);
    CK(cudaMemset(g_stamps[d].count, 0, sizeof(int)));
  }
  CK(cudaSetDevice(0));
}

struct Dev {
  int id;
  cudaStream_t s;
};

// Times `replays` calls of `step` on device 0's stream (devices 1.. joined by events).
template <typename Step>
double time_ms(const std::vector<Dev>& devs, Step step) {
  std::vector<cudaEvent_t> done(devs.size());
  for (size_t i = 0; i < devs.size(); ++i) {
    CK(cudaSetDevice(devs[i].id));
    CK(cudaEventCreateWithFlags(&done[i], cudaEventDisableTiming));
  }
  for (int i = 0; i < 5; ++i) step();
  for (const Dev& d : devs) { CK(cudaSetDevice(d.id)); CK(cudaStreamSynchronize(d.s)); }
  CK(cudaSetDevice(devs[0].id));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  CK(cudaEventRecord(a, devs[0].s));
  for (int i = 0; i < g_replays; ++i) step();
  // The end: every device's stream done.
  for (size_t i = 1; i < devs.size(); ++i) {
    CK(cudaSetDevice(devs[i].id));
    CK(cudaEventRecord(done[i], devs[i].s));
    CK(cudaSetDevice(devs[0].id));
    CK(cudaStreamWaitEvent(devs[0].s, done[i], 0));
  }
  CK(cudaSetDevice(devs[0].id));
  CK(cudaEventRecord(b, devs[0].s));
  CK(cudaEventSynchronize(b));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, a, b));
  return ms / g_replays;
}

// Inside a capture: `to`'s stream waits for what `from`'s stream has so far.
void edge(const Dev& from, const Dev& to) {
  cudaEvent_t e;
  CK(cudaSetDevice(from.id));
  CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  CK(cudaEventRecord(e, from.s));
  CK(cudaSetDevice(to.id));
  CK(cudaStreamWaitEvent(to.s, e, 0));
}

cudaGraphExec_t instantiate(cudaGraph_t g) {
  cudaGraphExec_t e;
  CK(cudaGraphInstantiate(&e, g, 0));
  CK(cudaGraphDestroy(g));
  return e;
}

// One graph on devs[0]'s stream; devs[1..] forked in; `mid_edges` cross-device
// edges in the middle of the chains (device k waits for device 0's half way).
cudaGraphExec_t capture(const std::vector<Dev>& devs, int mid_edges) {
  CK(cudaSetDevice(devs[0].id));
  CK(cudaStreamBeginCapture(devs[0].s, cudaStreamCaptureModeRelaxed));
  for (size_t i = 1; i < devs.size(); ++i) edge(devs[0], devs[i]);
  const int pieces = mid_edges + 1;
  for (int p = 0; p < pieces; ++p) {
    for (const Dev& d : devs) {
      CK(cudaSetDevice(d.id));
      chain(d.s, g_kernels / pieces);
    }
    if (p + 1 < pieces)
      for (size_t i = 1; i < devs.size(); ++i) edge(devs[0], devs[i]);
  }
  for (size_t i = 1; i < devs.size(); ++i) edge(devs[i], devs[0]);
  CK(cudaSetDevice(devs[0].id));
  cudaGraph_t g;
  CK(cudaStreamEndCapture(devs[0].s, &g));
  return instantiate(g);
}

// DataParallel's step boundary: device 1 fetches its input chunk (1.5 MiB)
// and targets (1 KiB) from device 0 at the start and sends its loss (4 B... 16 B)
// and outputs (2.5 KiB) back at the end, by copy engine or by kernels.
cudaGraphExec_t capture_scatter_gather(const std::vector<Dev>& devs, bool kernels) {
  static void *x0, *x1, *y0, *y1, *l0, *l1, *o0, *o1;
  if (!x0) {
    CK(cudaSetDevice(0));
    CK(cudaMalloc(&x0, 3 << 20)); CK(cudaMalloc(&y0, 2048)); CK(cudaMalloc(&l0, 64)); CK(cudaMalloc(&o0, 8192));
    CK(cudaSetDevice(1));
    CK(cudaMalloc(&x1, 3 << 20)); CK(cudaMalloc(&y1, 2048)); CK(cudaMalloc(&l1, 64)); CK(cudaMalloc(&o1, 8192));
  }
  auto copy = [&](void* dst, const void* src, size_t bytes, cudaStream_t st) {
    if (kernels) {
      const size_t n = bytes / 16;
      copy_kernel<<<static_cast<unsigned>(std::min<size_t>((n + 255) / 256, 264)), 256, 0, st>>>(
          static_cast<const float4*>(src), static_cast<float4*>(dst), n);
    } else {
      CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, st));
    }
  };
  CK(cudaSetDevice(0));
  CK(cudaStreamBeginCapture(devs[0].s, cudaStreamCaptureModeRelaxed));
  edge(devs[0], devs[1]);
  CK(cudaSetDevice(1));
  copy(y1, static_cast<char*>(y0) + 1024, 1024, devs[1].s);
  copy(x1, static_cast<char*>(x0) + (3 << 19), 3 << 19, devs[1].s);
  for (const Dev& d : devs) {
    CK(cudaSetDevice(d.id));
    chain(d.s, g_kernels);
  }
  CK(cudaSetDevice(1));
  copy(static_cast<char*>(l0) + 16, l1, 16, devs[1].s);
  copy(static_cast<char*>(o0) + 2560, o1, 2560, devs[1].s);
  edge(devs[1], devs[0]);
  CK(cudaSetDevice(0));
  cudaGraph_t g;
  CK(cudaStreamEndCapture(devs[0].s, &g));
  return instantiate(g);
}

cudaGraphExec_t capture_one(const Dev& d) {
  CK(cudaSetDevice(d.id));
  CK(cudaStreamBeginCapture(d.s, cudaStreamCaptureModeRelaxed));
  chain(d.s, g_kernels);
  cudaGraph_t g;
  CK(cudaStreamEndCapture(d.s, &g));
  return instantiate(g);
}

double g_kernel_us = 20.0;

// The overhead: the replay's time beyond its chain of kernels on one device.
void report(const char* what, double ms) {
  std::printf("graph_launch %-58s %9.1f us per replay, %7.1f us beyond the kernels\n", what, ms * 1e3,
              ms * 1e3 - g_kernels * g_kernel_us);
  int n = 0;
  CK(cudaGetDeviceCount(&n));
  print_gaps(std::min(n, 2));
}

}  // namespace

int main(int argc, char** argv) {
  g_kernels = argc > 1 ? std::atoi(argv[1]) : 400;
  const double kernel_us = g_kernel_us = argc > 2 ? std::atof(argv[2]) : 20.0;
  g_replays = argc > 3 ? std::atoi(argv[3]) : 200;
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::fprintf(stderr, "graph_launch: no CUDA device here\n");
    return 1;
  }
  g_cycles = static_cast<long long>(kernel_us * 1e3);  // nanoseconds
  std::vector<Dev> devs;
  for (int i = 0; i < std::min(n, 2); ++i) {
    Dev d{i, nullptr};
    CK(cudaSetDevice(i));
    CK(cudaStreamCreateWithFlags(&d.s, cudaStreamNonBlocking));
    devs.push_back(d);
    CK(cudaMalloc(&g_stamps[i].begin, 4096 * 8));
    CK(cudaMalloc(&g_stamps[i].end, 4096 * 8));
    CK(cudaMalloc(&g_stamps[i].count, sizeof(int)));
    CK(cudaMemset(g_stamps[i].count, 0, sizeof(int)));
  }
  for (int i = 1; i < static_cast<int>(devs.size()); ++i) {
    CK(cudaSetDevice(0));
    (void)cudaDeviceEnablePeerAccess(i, 0);
    CK(cudaSetDevice(i));
    (void)cudaDeviceEnablePeerAccess(0, 0);
  }
  (void)cudaGetLastError();
  // The chain alone, eagerly (the kernels' own time, launch-bound or not).
  std::vector<Dev> one{devs[0]};
  const double eager = time_ms(one, [&] { CK(cudaSetDevice(0)); chain(devs[0].s, g_kernels); });
  std::printf("graph_launch %d kernels of %.0f us a device, %d replays\n", g_kernels, kernel_us, g_replays);
  report("eager chain, 1 device", eager);
  cudaGraphExec_t g1 = capture_one(devs[0]);
  const double t1 = time_ms(one, [&] { CK(cudaGraphLaunch(g1, devs[0].s)); });
  report("one graph, 1 device", t1);
  {
    // Chorus's replay: the caller's stream writes the inputs, the graph's
    // stream waits for it, and the caller's stream waits for the replay.
    cudaStream_t caller;
    CK(cudaStreamCreateWithFlags(&caller, cudaStreamNonBlocking));
    cudaEvent_t ready, replayed;
    CK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&replayed, cudaEventDisableTiming));
    void* buf;
    CK(cudaMalloc(&buf, 1 << 20));
    report("one graph, 1 device, a memset between replays", time_ms(one, [&] {
             CK(cudaMemsetAsync(buf, 1, 1 << 20, devs[0].s));
             CK(cudaGraphLaunch(g1, devs[0].s));
           }));
    report("one graph, 1 device, an idle stream's event waited for", time_ms(one, [&] {
             CK(cudaEventRecord(ready, caller));
             CK(cudaStreamWaitEvent(devs[0].s, ready, 0));
             CK(cudaGraphLaunch(g1, devs[0].s));
           }));
    report("one graph, 1 device, through a caller's stream", time_ms(one, [&] {
             CK(cudaMemsetAsync(buf, 1, 1 << 20, caller));
             CK(cudaEventRecord(ready, caller));
             CK(cudaStreamWaitEvent(devs[0].s, ready, 0));
             CK(cudaGraphLaunch(g1, devs[0].s));
             CK(cudaEventRecord(replayed, devs[0].s));
             CK(cudaStreamWaitEvent(caller, replayed, 0));
           }));
  }
  if (devs.size() < 2) {
    std::printf("graph_launch: one GPU: the 2-device cases need two\n");
    return 0;
  }
  cudaGraphExec_t g2 = capture(devs, 0);
  report("one graph over 2 devices (fork, join)", time_ms(devs, [&] { CK(cudaSetDevice(0)); CK(cudaGraphLaunch(g2, devs[0].s)); }));
  cudaGraphExec_t g2m = capture(devs, 2);
  report("one graph over 2 devices + 2 cross-device edges", time_ms(devs, [&] { CK(cudaSetDevice(0)); CK(cudaGraphLaunch(g2m, devs[0].s)); }));
  cudaGraphExec_t gce = capture_scatter_gather(devs, false), gk = capture_scatter_gather(devs, true);
  report("one graph over 2 devices, scatter/gather by copy engine", time_ms(devs, [&] { CK(cudaSetDevice(0)); CK(cudaGraphLaunch(gce, devs[0].s)); }));
  report("one graph over 2 devices, scatter/gather by kernels", time_ms(devs, [&] { CK(cudaSetDevice(0)); CK(cudaGraphLaunch(gk, devs[0].s)); }));
  cudaGraphExec_t ga = capture_one(devs[0]), gb = capture_one(devs[1]);
  auto both = [&] {
    CK(cudaSetDevice(0));
    CK(cudaGraphLaunch(ga, devs[0].s));
    CK(cudaSetDevice(1));
    CK(cudaGraphLaunch(gb, devs[1].s));
  };
  report("a graph per device, independent", time_ms(devs, both));
  {
    // One host thread per device, each launching its own graph.
    auto threads = [&] {
      std::thread t1([&] { CK(cudaSetDevice(1)); CK(cudaGraphLaunch(gb, devs[1].s)); });
      CK(cudaSetDevice(0));
      CK(cudaGraphLaunch(ga, devs[0].s));
      t1.join();
    };
    report("a graph per device, a host thread each (joined per step)", time_ms(devs, threads));
  }
  {
    // The same with the roles swapped: device 1 times the replays and is launched to first.
    std::vector<Dev> swapped{devs[1], devs[0]};
    report("a graph per device, independent, device 1 first", time_ms(swapped, [&] {
             CK(cudaSetDevice(1));
             CK(cudaGraphLaunch(gb, devs[1].s));
             CK(cudaSetDevice(0));
             CK(cudaGraphLaunch(ga, devs[0].s));
           }));
    CK(cudaSetDevice(0));
  }
  report("device 1's graph alone", time_ms({devs[1]}, [&] { CK(cudaSetDevice(1)); CK(cudaGraphLaunch(gb, devs[1].s)); }));
  cudaEvent_t e0, e1;
  CK(cudaSetDevice(0));
  CK(cudaEventCreateWithFlags(&e0, cudaEventDisableTiming));
  CK(cudaSetDevice(1));
  CK(cudaEventCreateWithFlags(&e1, cudaEventDisableTiming));
  report("a graph per device, device 0 waits for device 1 each step", time_ms(devs, [&] {
           both();
           CK(cudaSetDevice(1));
           CK(cudaEventRecord(e1, devs[1].s));
           CK(cudaSetDevice(0));
           CK(cudaStreamWaitEvent(devs[0].s, e1, 0));
         }));
  report("a graph per device, each waits for the other each step", time_ms(devs, [&] {
           both();
           CK(cudaSetDevice(1));
           CK(cudaEventRecord(e1, devs[1].s));
           CK(cudaSetDevice(0));
           CK(cudaEventRecord(e0, devs[0].s));
           CK(cudaStreamWaitEvent(devs[0].s, e1, 0));
           CK(cudaSetDevice(1));
           CK(cudaStreamWaitEvent(devs[1].s, e0, 0));
         }));
  return 0;
}
