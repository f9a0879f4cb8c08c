// chorus_pipeline_probe: one rank of a pipeline test job across processes
// (started by tests/distributed/pipeline.sh through chorus launch). Every rank also
// trains, alone, a reference copy of the model on one device on the whole
// global batch -- the independent result the pipeline must reproduce -- and
// compares losses and weights.
//
//   stages SCHEDULE   one stage per process (world size = stages; interleaved:
//                     two per process, stage s on rank s % world, the last
//                     rank's activations back to rank 0), over the process
//                     group's send/recv: 4 SGD steps with 4 micro-batches;
//                     each rank compares the weights of its own stages, the
//                     last rank the losses too.
//   dp SCHEDULE       data parallelism over pipelines: each process runs a
//                     2-stage pipeline on cpu:0 and cpu:1 on its share of the
//                     global batch, gradients averaged over the processes.
//   both SCHEDULE     4 processes: two pipelines of 2 processes (ranks 0, 1
//                     and 2, 3; interleaved: two stages each), each on half
//                     the batch, the stages' gradients averaged over the data
//                     groups {0, 2} and {1, 3} (stage_group and data_group).
// PROBE_DEVICE=cuda: the stages on cuda:LOCAL_RANK over NCCL (TF32 off; the
// reference stays on the CPU), for the GPU machines (scripts/gpu_check.sh).
// Prints "rank R: ok ..." and exits 0, or FAIL lines and exits 1.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include <chorus/chorus.h>
#include <chorus/distributed/init.h>
#include <chorus/optim/sgd.h>
#include <chorus/parallel/pipeline.h>
#ifdef CHORUS_WITH_CUDA
#include <chorus/cuda/blas/blas.h>
#endif

using namespace chorus;
namespace F = chorus::nn::functional;

namespace {

int failures = 0;
void expect(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  }
}

double rel_err(const Tensor& a, const Tensor& b) {
  const std::vector<double> u = a.to(cpu_device(0)).to(kFloat64).to_vector<double>();
  const std::vector<double> v = b.to(cpu_device(0)).to(kFloat64).to_vector<double>();
  double num = 0, den = 0;
  for (size_t i = 0; i < u.size(); ++i) {
    num += (u[i] - v[i]) * (u[i] - v[i]);
    den += v[i] * v[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

std::shared_ptr<nn::Sequential> model() {
  manual_seed(5);
  return std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
      std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(64, 32), std::make_shared<nn::ReLU>(),
      std::make_shared<nn::Linear>(32, 32), std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(32, 16),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(16, 4)});
}

constexpr int64_t kGlobal = 24;
constexpr int kSteps = 4;

std::pair<Tensor, Tensor> global_batch(int step) {
  manual_seed(1000 + step);
  return {randn({kGlobal, 1, 8, 8}), randint(0, 4, {kGlobal})};
}

Tensor ce(const Tensor& out, const Tensor& t) { return F::cross_entropy(out, t); }

// The reference: one device, whole global batch.
std::pair<std::vector<double>, NamedTensors> reference() {
  auto m = model();
  optim::SGD opt(m->parameters(), {0.1, 0.9});
  std::vector<double> losses;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = global_batch(step);
    opt.zero_grad();
    Tensor loss = ce(m->forward(x), y);
    loss.backward();
    opt.step();
    losses.push_back(loss.item());
  }
  return {losses, m->named_parameters()};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: chorus_pipeline_probe stages|dp|both gpipe|1f1b|interleaved\n");
    return 2;
  }
  const std::string mode = argv[1];
  try {
    dist::InitOptions io;
    io.timeout = std::chrono::seconds(60);
    const char* dev_env = std::getenv("PROBE_DEVICE");
    const bool cuda = dev_env && std::string(dev_env) == "cuda";
    const char* local = std::getenv("LOCAL_RANK");
    const Device stage_device = cuda ? cuda_device(local ? std::atoi(local) : 0) : cpu_device(0);
    if (cuda) {
      io.backend = "nccl";
      set_device(stage_device);
#ifdef CHORUS_WITH_CUDA
      cuda::set_allow_tf32(false);
#endif
    }
    auto pg = dist::init_process_group(io);
    const int rank = pg->rank(), world = pg->size();
    auto [ref_losses, ref_params] = reference();
    parallel::PipelineOptions o;
    o.micro_batches = 4;
    o.schedule = parallel::parse_schedule(argv[2]);
    std::vector<Device> devices;
    std::vector<int64_t> balance;
    dist::ProcessGroupPtr data = pg;  // over which the loss is averaged (dp, both)
    if (mode == "both") {
      if (world != 4) throw std::runtime_error("both: needs 4 processes, got " + std::to_string(world));
      // Every rank creates every group, in one order (new_group gives null to non-members).
      dist::ProcessGroupPtr g[4] = {pg->new_group({0, 1}), pg->new_group({2, 3}), pg->new_group({0, 2}),
                                    pg->new_group({1, 3})};
      o.stage_group = g[0] ? g[0] : g[1];
      o.data_group = data = g[2] ? g[2] : g[3];
      devices = {stage_device};
      balance = o.schedule == parallel::Schedule::Interleaved ? std::vector<int64_t>{2, 3, 1, 2}
                                                              : std::vector<int64_t>{3, 5};
    } else if (mode == "stages") {
      o.stage_group = pg;
      devices = {stage_device};
      if (o.schedule == parallel::Schedule::Interleaved)  // two stages per rank (8 layers)
        balance = world == 2 ? std::vector<int64_t>{2, 3, 1, 2} : world == 3 ? std::vector<int64_t>{1, 2, 1, 2, 1, 1}
                                                               : std::vector<int64_t>(8, 1);
      else
        balance = world == 2 ? std::vector<int64_t>{3, 5} : world == 3 ? std::vector<int64_t>{3, 2, 3}
                                                                     : std::vector<int64_t>{2, 2, 2, 2};
    } else {
      o.data_group = pg;
      devices = {cpu_device(0), cpu_device(1)};
      balance = o.schedule == parallel::Schedule::Interleaved ? std::vector<int64_t>{2, 2, 2, 2}
                                                              : std::vector<int64_t>{3, 5};
    }
    parallel::Pipeline pipe(model(), balance, devices, o);
    optim::SGD opt(pipe.local_parameters(), {0.1, 0.9});
    const int replicas = mode == "dp" ? world : mode == "both" ? 2 : 1;
    const int replica = mode == "dp" ? rank : mode == "both" ? rank / 2 : 0;
    const int64_t share = kGlobal / replicas;
    double worst_loss = 0;
    bool has_loss = false;
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = global_batch(step);
      if (replicas > 1) {
        x = x.narrow(0, replica * share, share);
        y = y.narrow(0, replica * share, share);
      }
      opt.zero_grad();
      auto r = pipe.train_step(x.to(stage_device), y.to(stage_device), ce);
      opt.step();
      if (r.loss.defined()) {
        has_loss = true;
        double loss = r.loss.item();
        if (replicas > 1) {  // the global loss: the average of the replicas' means
          Tensor t = from_vector(std::vector<double>{loss}, {1}).to(data->device());
          data->all_reduce(t, dist::ReduceOp::Avg)->wait();
          loss = t.item();
        }
        worst_loss = std::max(worst_loss, std::abs(loss - ref_losses[static_cast<size_t>(step)]) /
                                              std::abs(ref_losses[static_cast<size_t>(step)]));
      }
    }
    expect(worst_loss <= 1e-5, "losses differ from one device's by " + std::to_string(worst_loss));
    double worst = 0;
    int compared = 0;
    const NamedTensors got = pipe.named_parameters();
    const std::vector<Tensor> mine = pipe.local_parameters();
    for (size_t i = 0; i < got.size(); ++i) {
      if (std::find_if(mine.begin(), mine.end(), [&](const Tensor& t) { return t.is_same(got[i].second); }) ==
          mine.end())
        continue;  // another rank's stage
      expect(got[i].first == ref_params[i].first, "parameter names differ: " + got[i].first);
      worst = std::max(worst, rel_err(got[i].second, ref_params[i].second));
      ++compared;
    }
    expect(compared > 0, "no parameters on this rank");
    expect(worst <= 1e-5, "weights differ from one device's by " + std::to_string(worst));
    pg->barrier()->wait();
    if (failures) return 1;
    char loss_text[96] = "(the loss is on the last rank)";
    if (has_loss) std::snprintf(loss_text, sizeof loss_text, "loss relative error %.2e", worst_loss);
    std::printf("rank %d: ok %s %s, %d processes, %d parameters compared, weights relative error %.2e, %s\n", rank,
                mode.c_str(), argv[2], world, compared, worst, loss_text);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAIL: %s\n", e.what());
    return 1;
  }
}
