// Concurrency from one thread: does work issued by ONE host thread to N GPUs
// run on all of them at once? (DESIGN.md, "Devices and execution": every CUDA
// op is enqueued and returns at once; nothing waits for the GPU except explicit
// synchronisation.)
//
// Each device gets a chain of `--chain` (20) matmuls of `--size` (8192) square
// matrices, x <- x @ w, issued round-robin — step 0 on every device, then step
// 1 on every device, ... — from the main thread, then one synchronize(). With
// truly asynchronous ops, N devices doing N times the work take about as long
// as one device doing its share: the reported ratio t(N) / t(1) should be close
// to 1 (target <= 1.2). Anything that makes the host wait (a synchronous
// cudaMalloc/cudaFree, a blocking copy, an implicit device sync) serialises the
// devices and pushes the ratio towards N.
//
// No DeviceGuard is set in the loop: an op runs on the device of its first
// operand (Note [Cross-device operands]), so x[d] @ w[d] runs on device d.
//
// Usage: bench_concurrency [--dtype=fp32|bf16] [--size=N] [--chain=N] [--devices=N]
//                          [--iters=N] [--cpu] [benchmark flags]
//   --cpu runs the same loop on logical CPU devices (cpu:0..), a smoke run of
//   the code path: CPU ops are synchronous, so expect a ratio near N there.
#include <benchmark/benchmark.h>

#include <chorus/chorus.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

namespace {

using namespace chorus;

struct Config {
  bool cpu = false;
  int64_t size = 8192;  // CPU default is smaller; see parse()
  int chain = 20;
  int devices = 0;      // 0: all GPUs (or 2 logical CPU devices with --cpu)
  int iters = 3;
  DType dtype = kFloat32;
};

// Takes our flags out of argv, leaving Google Benchmark's own.
Config parse(int* argc, char** argv) {
  Config c;
  bool size_given = false;
  int out = 1;
  for (int i = 1; i < *argc; ++i) {
    std::string a = argv[i];
    auto value = [&](const char* flag) -> const char* {
      size_t n = std::strlen(flag);
      return a.compare(0, n, flag) == 0 ? argv[i] + n : nullptr;
    };
    if (a == "--cpu") {
      c.cpu = true;
    } else if (const char* v = value("--size=")) {
      c.size = std::atoll(v);
      size_given = true;
    } else if (const char* v = value("--chain=")) {
      c.chain = std::atoi(v);
    } else if (const char* v = value("--devices=")) {
      c.devices = std::atoi(v);
    } else if (const char* v = value("--iters=")) {
      c.iters = std::atoi(v);
    } else if (const char* v = value("--dtype=")) {
      std::string d = v;
      if (d == "fp32" || d == "float32") {
        c.dtype = kFloat32;
      } else if (d == "bf16" || d == "bfloat16") {
        c.dtype = kBFloat16;
      } else {
        std::fprintf(stderr, "bench_concurrency: --dtype must be fp32 or bf16, got '%s'\n", v);
        std::exit(2);
      }
    } else {
      argv[out++] = argv[i];
    }
  }
  *argc = out;
  if (c.cpu && !size_given) c.size = 256;
  if (c.size <= 0 || c.chain <= 0 || c.iters <= 0 || c.devices < 0) {
    std::fprintf(stderr, "bench_concurrency: --size, --chain and --iters must be > 0\n");
    std::exit(2);
  }
  return c;
}

// One device's chain: x0 and a weight scaled by 1/sqrt(n) so that the values
// stay O(1) over 20 products (no inf/NaN slowing anything down).
struct Chain {
  Tensor x0, w;
};

std::vector<Chain> make_chains(const std::vector<Device>& devices, const Config& c) {
  std::vector<Chain> chains;
  for (const Device& d : devices) {
    Tensor x0 = randn({c.size, c.size}, {kFloat32, d}).to(c.dtype);
    Tensor w = (randn({c.size, c.size}, {kFloat32, d}) * (1.0 / std::sqrt(double(c.size)))).to(c.dtype);
    chains.push_back({x0, w});
  }
  return chains;
}

// The measured work: all chains, round-robin, from this one thread; then wait.
void issue_and_wait(const std::vector<Chain>& chains, int chain_length) {
  std::vector<Tensor> x;
  for (const Chain& ch : chains) x.push_back(ch.x0);
  for (int step = 0; step < chain_length; ++step)
    for (size_t d = 0; d < chains.size(); ++d) x[d] = matmul(x[d], chains[d].w);
  synchronize();
  benchmark::DoNotOptimize(x.data());
}

void run_chains(benchmark::State& state, std::vector<Device> devices, Config c) {
  try {
    NoGradGuard no_grad;
    auto chains = make_chains(devices, c);
    issue_and_wait(chains, 1);  // warm-up: library handles, memory pools
    for (auto _ : state) issue_and_wait(chains, c.chain);
    const double flops = 2.0 * double(c.size) * c.size * c.size * c.chain * devices.size();
    state.counters["TFLOP/s"] = benchmark::Counter(flops * 1e-12, benchmark::Counter::kIsIterationInvariantRate);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

// Console output as usual, and the per-iteration times kept for the summary.
class Capture : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) ms[r.run_name.function_name] = r.GetAdjustedRealTime();
    ConsoleReporter::ReportRuns(runs);
  }
  std::map<std::string, double> ms;
};

}  // namespace

int main(int argc, char** argv) {
  Config c = parse(&argc, argv);

  std::vector<Device> devices;
  if (c.cpu) {
    int n = c.devices ? c.devices : 2;
    for (int i = 0; i < n && i < cpu_device_count(); ++i) devices.push_back(cpu_device(i));
  } else {
    const int gpus = cuda_device_count();
    if (gpus < 2) {
      std::printf("bench_concurrency: needs at least 2 CUDA devices, found %d%s; skipping.\n"
                  "  (run with --cpu for a smoke run of the same loop on logical CPU devices)\n",
                  gpus, cuda_is_available() ? "" : " (no GPU or a CPU-only build)");
      return 0;
    }
    int n = c.devices ? std::min(c.devices, gpus) : gpus;
    for (int i = 0; i < n; ++i) devices.push_back(cuda_device(i));
  }
  if (devices.size() < 2) {
    std::printf("bench_concurrency: needs at least 2 devices, have %zu; skipping.\n", devices.size());
    return 0;
  }

  const std::string shape = std::to_string(c.size) + "x" + std::to_string(c.size) + " " + dtype_name(c.dtype);
  std::printf("concurrency from one thread: %d matmuls of %s per device, issued round-robin\n", c.chain,
              shape.c_str());
  if (c.cpu)
    std::printf("  on logical CPU devices: CPU ops run synchronously on the issuing thread, so this is a\n"
                "  smoke run of the code path, not concurrency; expect a ratio near %zu.\n",
                devices.size());

  const std::string one = "Concurrency/devices:1", all = "Concurrency/devices:" + std::to_string(devices.size());
  for (auto [name, devs] : {std::pair{one, std::vector<Device>{devices[0]}}, std::pair{all, devices}})
    benchmark::RegisterBenchmark(name.c_str(), run_chains, devs, c)
        ->Iterations(c.iters)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);

  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  Capture reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();

  const double t1 = reporter.ms.count(one) ? reporter.ms[one] : 0, tn = reporter.ms.count(all) ? reporter.ms[all] : 0;
  if (t1 <= 0 || tn <= 0) return 0;  // filtered out, or failed (the error is in the table above)
  const double ratio = tn / t1;
  std::printf("\n1 device: %.2f ms   %zu devices: %.2f ms (%zux the work)   ratio %.3f (target <= 1.2%s)\n", t1,
              devices.size(), tn, devices.size(), ratio, c.cpu ? "; not expected on CPU" : "");
  if (!c.cpu) std::printf("%s\n", ratio <= 1.2 ? "PASS: the devices ran concurrently" : "FAIL: the devices were serialised");
  return 0;
}
