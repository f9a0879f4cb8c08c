#include "bench_ddp.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "chorus/core/backend.h"
#include "chorus/core/env_switches.h"
#include "chorus/core/error.h"
#include "chorus/core/rng.h"
#include "chorus/data_parallel/ddp.h"
#include "chorus/data_parallel/sharded.h"
#include "chorus/distributed/init.h"
#include "chorus/models/models.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/factory.h"
#include "chorus/optim/sgd.h"
#include "commands.h"
#include "launch.h"
#include "train_step.h"
#include "train_zero.h"

namespace chorus::app {

namespace {

int free_local_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  CHORUS_CHECK(fd >= 0, "chorus bench: no socket for a free port");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  ::close(fd);
  CHORUS_CHECK(ok, "chorus bench: could not find a free local port");
  return ntohs(a.sin_port);
}

std::string fmt(double v) {
  std::ostringstream os;
  os.precision(17);
  os << v;
  return os.str();
}

}  // namespace

nlohmann::ordered_json bench_ddp_row(const BenchConfig& c, const std::string& strategy,
                                     const std::vector<Device>& devices, int64_t n) {
  const std::string row_file = (std::filesystem::temp_directory_path() /
                                ("chorus-bench-" + std::to_string(::getpid()) + "-" + std::to_string(n) + ".json"))
                                   .string();
  std::string list;
  for (int64_t i = 0; i < n; ++i) list += (i ? "," : "") + devices[static_cast<size_t>(i)].str();
  LaunchConfig lc;
  lc.nproc_per_node = std::to_string(n);
  lc.master_port = free_local_port();
  lc.grace_s = 5;
  lc.command = {std::filesystem::read_symlink("/proc/self/exe").string(), "bench", "--ddp-worker",
                "--strategy", strategy, "--model", c.model, "--devices", list, "--precision", c.precision,
                "--batch-size", std::to_string(c.batch_size), "--steps", std::to_string(c.steps),
                "--warmup", std::to_string(c.warmup), "--bucket-mb", fmt(c.bucket_mb), "--comm-hook", c.comm_hook};
  if (c.last_bucket_mb) {
    lc.command.push_back("--last-bucket-mb");
    lc.command.push_back(fmt(*c.last_bucket_mb));
  }
  if (c.channels_last) lc.command.push_back("--channels-last");
  if (c.broadcast_buffers) lc.command.push_back("--broadcast-buffers");
  if (c.no_cuda_graphs) lc.command.push_back("--no-cuda-graphs");
  if (!c.reshard_after_forward) lc.command.push_back("--no-reshard-after-forward");
  if (!c.zero_prefetch) lc.command.push_back("--no-zero-prefetch");
  ::setenv("CHORUS_BENCH_ROW", row_file.c_str(), 1);
  const int rc = run_launch(lc);
  ::unsetenv("CHORUS_BENCH_ROW");
  CHORUS_CHECK(rc == 0, "chorus bench --strategy ", strategy, ": the ", n, "-process run failed (exit ", rc,
               "; its output is above)");
  std::ifstream in(row_file);
  CHORUS_CHECK(in.good(), "chorus bench --strategy ", strategy, ": the ", n, "-process run left no result in ", row_file);
  nlohmann::ordered_json row = nlohmann::ordered_json::parse(in);
  std::filesystem::remove(row_file);
  return row;
}

int run_bench_ddp_worker(const BenchConfig& c) {
  std::optional<dist::LaunchEnv> env = dist::read_launch_env();
  CHORUS_CHECK(env.has_value(), "--ddp-worker runs under chorus bench --strategy ddp, which launches it");
  const std::vector<Device> all = parse_devices(c.devices);
  CHORUS_CHECK(env->local_rank < static_cast<int>(all.size()), "rank ", env->rank, " has no device in --devices ", c.devices);
  const Device dev = all[static_cast<size_t>(env->local_rank)];
  if (dev.is_cuda()) set_device(dev);
  dist::InitOptions io;
  io.backend = dev.is_cuda() ? "nccl" : "gloo";
  dist::ProcessGroupPtr pg = dist::init_process_group(*env, io);

  manual_seed(0);
  const bool small = c.model == "mlp" || c.model == "cnn";
  models::ModelSpec spec{small ? Shape{1, 28, 28} : Shape{3, 32, 32}, 10};
  nn::ModulePtr model = models::make_model(c.model, spec);
  model->to(dev);
  if (c.channels_last && dev.is_cuda()) model->to_channels_last();
  const int stage = zero_stage_of(c.strategy, c);
  nn::ModulePtr net;
  std::shared_ptr<dist::ShardedDataParallel> sdp;
  if (stage > 0) {
    // As chorus train --strategy zero shards an image model (shard_model).
    dist::ShardOptions so =
        zero_flag_options(stage, c.bucket_mb, c.reshard_after_forward, c.comm_hook, c.zero_prefetch);
    if (stage == 3) so.units = models::residual_blocks(model);
    so.broadcast_buffers = c.broadcast_buffers;
    net = sdp = std::make_shared<dist::ShardedDataParallel>(model, pg, so);
  } else {
    dist::DDPOptions o;
    o.bucket_bytes = mib_to_bytes(c.bucket_mb);
    if (c.last_bucket_mb) o.last_bucket_bytes = mib_to_bytes(*c.last_bucket_mb);
    o.comm_hook = dist::parse_comm_hook(c.comm_hook);
    o.broadcast_buffers = c.broadcast_buffers;
    net = std::make_shared<dist::DistributedDataParallel>(model, pg, o);
  }
  optim::SGD opt(sdp ? sdp->shard_parameters() : model->parameters(), {0.1, 0.9, 0.0, 5e-4, true});
  Shape in{c.batch_size};
  in.insert(in.end(), spec.input.begin(), spec.input.end());
  Tensor x = randn(in, {kFloat32, dev});
  if (c.channels_last && dev.is_cuda()) x = ops::to_channels_last(x);
  Tensor y = randint(0, 10, {c.batch_size}, {kInt64, dev});
  TrainStep step{net, &opt, std::nullopt, 0.0};
  if (c.precision == "bf16") step.autocast = kBFloat16;
  // Note [DDP in a CUDA graph]: captured after the warm-up's first steps.
  parallel::GraphedStepOptions graph_options;
  graph_options.on_fallback = [&](const std::string& line) {
    if (pg->rank() == 0) std::fprintf(stderr, "chorus bench: %s\n", line.c_str());
  };
  if (!c.no_cuda_graphs && cuda_graphs_apply(stage > 0 ? "zero" : "ddp", {dev})) step.enable_cuda_graphs(graph_options);
  Tensor loss;
  for (int64_t i = 0; i < c.warmup; ++i) loss = step.run(x, y).loss;
  synchronize(dev);
  pg->barrier()->wait();
  backend(dev).reset_peak_bytes(dev);
  // CHORUS_PROFILER_RANGE=1: an external profiler (nsys) records the timed steps only.
  const char* range_env = chorus::env::get("CHORUS_PROFILER_RANGE");
  const bool range = range_env && std::string(range_env) == "1";
  if (range) backend(dev).profiler_range(true);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < c.steps; ++i) loss = step.run(x, y).loss;
  // Host time to issue the steps: near the total, the step is bound by the host.
  const double issue = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  synchronize(dev);
  if (range) backend(dev).profiler_range(false);
  pg->barrier()->wait();  // the slowest rank's time is the job's
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (pg->rank() != 0) return 0;
  const bool graphed = step.graph && step.graph->replays() >= c.steps;
  const double world = static_cast<double>(pg->size());
  nlohmann::ordered_json row = {{"img_per_s", world * static_cast<double>(c.batch_size * c.steps) / dt},
                                {"step_ms", 1000.0 * dt / static_cast<double>(c.steps)},
                                {"peak_mem_bytes", backend(dev).peak_bytes(dev)},
                                {"host_issue_ms", 1000.0 * issue},
                                {"cuda_graphs", graphed},
                                {"loss", loss.item()}};
  const char* path = chorus::env::get("CHORUS_BENCH_ROW");
  CHORUS_CHECK(path != nullptr, "--ddp-worker: CHORUS_BENCH_ROW is not set");
  std::ofstream(path) << row.dump();
  return 0;
}

}  // namespace chorus::app
