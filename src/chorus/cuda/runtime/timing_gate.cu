// Note [Timing behind a gate] (timing_gate.h).
#include "chorus/cuda/runtime/timing_gate.h"

#include <atomic>
#include <mutex>

#include "chorus/cuda/runtime/context.h"

namespace chorus::cuda {

namespace {

// Most a gate holds its stream, in nanoseconds: far above the host time of
// issuing a handful of runs, far below anything a user would notice.
constexpr unsigned long long kMaxHoldNs = 500'000'000ull;

// Words in pinned, host-mapped memory shared by the gates of the process, one
// slot per generation modulo kSlots: a gate waits until its slot's `open`
// reaches its own generation; `expired` is the generation whose spin gave up.
// Each gate has a slot of its own, so concurrent gates (the device threads of
// a pipeline, each timing its tasks) never open each other early -- with one
// shared word, releasing a newer generation released every older one too and
// the pipeline's busy times took in the host's issue gaps. Slots are reused
// only after kSlots newer gates, far more than are ever closed at once.
constexpr uint32_t kSlots = 256;
struct GateWords {
  uint32_t open[kSlots];
  uint32_t expired[kSlots];
};

GateWords* gate_words() {
  static GateWords* words = [] {
    void* p = nullptr;
    CHORUS_CUDA_CHECK(cudaHostAlloc(&p, sizeof(GateWords), cudaHostAllocMapped | cudaHostAllocPortable));
    auto* w = static_cast<GateWords*>(p);
    for (uint32_t i = 0; i < kSlots; ++i) w->open[i] = w->expired[i] = 0;
    return w;  // leaked: kernels may read it until the process ends
  }();
  return words;
}

std::atomic<uint32_t>& next_generation() {
  static std::atomic<uint32_t> g{0};
  return g;
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Wrap-safe "a has reached b" for generations.
__host__ __device__ __forceinline__ bool reached(uint32_t a, uint32_t b) {
  return static_cast<int32_t>(a - b) >= 0;
}

__global__ void gate_kernel(GateWords* w, uint32_t generation, unsigned long long max_ns) {
  const unsigned long long start = global_ns();
  const uint32_t slot = generation % kSlots;
  while (!reached(*reinterpret_cast<volatile uint32_t*>(&w->open[slot]), generation)) {
    if (global_ns() - start > max_ns) {
      *reinterpret_cast<volatile uint32_t*>(&w->expired[slot]) = generation;
      return;
    }
    __nanosleep(2000);
  }
}

}  // namespace

StreamGate::StreamGate(cudaStream_t stream) : generation_(next_generation().fetch_add(1) + 1) {
  GateWords* w = gate_words();
  GateWords* dev = nullptr;
  CHORUS_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev), w, 0));
  gate_kernel<<<1, 1, 0, stream>>>(dev, generation_, kMaxHoldNs);
  CHORUS_CUDA_CHECK(cudaGetLastError());
}

StreamGate::~StreamGate() {
  if (!opened_) open();
}

void StreamGate::open() {
  opened_ = true;
  // Raise `open` to this generation unless a newer one was released already.
  std::atomic_ref<uint32_t> open(gate_words()->open[generation_ % kSlots]);
  uint32_t cur = open.load();
  while (!reached(cur, generation_) && !open.compare_exchange_weak(cur, generation_)) {
  }
}

bool StreamGate::expired() const {
  return std::atomic_ref<uint32_t>(gate_words()->expired[generation_ % kSlots]).load() == generation_;
}

}  // namespace chorus::cuda
