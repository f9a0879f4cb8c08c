#include "bench_pipeline.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>

#include <nlohmann/json.hpp>

#include "chorus/autograd/autocast.h"
#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/core/rng.h"
#include "chorus/core/warn.h"
#include "chorus/models/models.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/factory.h"
#include "chorus/optim/sgd.h"
#include "bench.h"
#include "commands.h"
#include "train_pipeline.h"
#include "train_step.h"

namespace chorus::app {

namespace {

std::string join(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

struct Row {
  double img_per_s = 0, step_ms = 0, loss = 0, bubble = -1, bubble_ideal = 0;  // bubble < 0: not measured
  bool graphed = false;
  std::vector<size_t> peaks;
  std::string balance;
};

Row bench_schedule(const BenchConfig& c, const std::vector<Device>& devs, const std::string& name,
                   std::optional<std::string>* balance) {
  manual_seed(0);
  const bool small = c.model == "mlp" || c.model == "cnn";
  models::ModelSpec spec{small ? Shape{1, 28, 28} : Shape{3, 32, 32}, 10};
  nn::ModulePtr model = models::make_model(c.model, spec);
  model->to(devs[0]);
  const bool cl = c.channels_last && devs[0].is_cuda();
  if (cl) model->to_channels_last();
  optim::SGD opt(model->parameters(), {0.1, 0.9, 0.0, 5e-4, true});
  Shape in{c.batch_size};
  in.insert(in.end(), spec.input.begin(), spec.input.end());
  Tensor x = randn(in, {kFloat32, devs[0]});
  if (cl) x = ops::to_channels_last(x);
  // The targets beside the batch (a graph's inputs share a device); the
  // pipeline takes them to the last stage.
  Tensor y = randint(0, 10, {c.batch_size}, {kInt64, devs[0]});

  PipelineChoice pc;
  const bool naive = name == "naive";
  pc.micro_batches = naive ? 1 : c.micro_batches;
  pc.schedule = naive ? "gpipe" : name;
  // Interleaved rows have more stages than the others: their own measured
  // balance unless one was given.
  pc.balance = name == "interleaved" && !c.balance ? std::nullopt : *balance;
  pc.recompute = c.recompute;
  pc.virtual_stages = name == "interleaved" ? c.virtual_stages : 0;
  const std::optional<DType> cast = c.precision == "bf16" ? std::optional<DType>(kBFloat16) : std::nullopt;
  std::shared_ptr<parallel::Pipeline> pipe;
  {
    AutocastGuard g(cast);
    Tensor sample = x.narrow(0, 0, std::max<int64_t>(1, c.batch_size / c.micro_batches));
    pipe = make_pipeline(model, devs, pc, sample);
  }
  // Every row of a run uses the first row's balance (when measured): the
  // schedules are then compared on the same split.
  if (!balance->has_value() && name != "interleaved") *balance = join(pipe->balance());
  TrainStep step{pipe, &opt, cast, 0.0};
  step.pipeline = pipe.get();
  // One CUDA graph over the stages' devices, captured in the warm-up
  // (Note [Pipelines and CUDA graphs]); --no-cuda-graphs to compare.
  std::string fallback;
  if (!c.no_cuda_graphs && cuda_graphs_apply("pipeline", devs)) {
    parallel::GraphedStepOptions go;
    go.devices = pipe->devices();
    go.on_fallback = [&fallback](const std::string& line) {
      if (fallback.empty()) warn(line);
      fallback = line;
    };
    step.enable_cuda_graphs(go);
  }
  Tensor loss;
  for (int64_t i = 0; i < c.warmup; ++i) loss = step.run(x, y).loss;
  for (const Device& d : devs) synchronize(d);
  for (const Device& d : devs) backend(d).reset_peak_bytes(d);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < c.steps; ++i) loss = step.run(x, y).loss;
  for (const Device& d : devs) synchronize(d);
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  Row r;
  r.img_per_s = static_cast<double>(c.batch_size * c.steps) / dt;
  r.step_ms = 1000.0 * dt / static_cast<double>(c.steps);
  r.loss = loss.item();
  r.graphed = step.graph && step.graph->replays() > 0;
  for (const Device& d : devs) r.peaks.push_back(backend(d).peak_bytes(d));
  // The bubble of an eager step: each device's busy time, measured on a few
  // more eager steps with every task timed on the device alone (behind a
  // gate, so no host gaps), against the time the timed steps took: the share
  // of the step each device spent idle. Not for a replayed graph: a replay
  // cannot be timed task by task, and the eager tasks' device time is longer
  // than the graph's (each of a micro-batch's small kernels waits a few
  // microseconds more behind the one before it in a stream than in a graph:
  // at micro-batches of 32 the eager busy time exceeded the whole graphed
  // step: benchmarks journal, session 14), so such a "bubble" would be meaningless.
  if (!r.graphed) {
    pipe->set_measure(true);
    std::vector<double> busy(devs.size(), 0.0);
    const int measured = 3;
    for (int i = 0; i < measured; ++i) {
      step.run_eager(x, y);
      const std::vector<double>& b = pipe->last_stats().busy_ms;
      for (size_t d = 0; d < b.size() && d < busy.size(); ++d) busy[d] += b[d] / measured;
    }
    pipe->set_measure(false);
    double mean_busy = 0;
    for (double b : busy) mean_busy += b / static_cast<double>(busy.size());
    r.bubble = std::max(0.0, 1.0 - mean_busy / r.step_ms);
  }
  const int D = static_cast<int>(devs.size()), S = static_cast<int>(pipe->num_stages());
  const int M = static_cast<int>(pc.micro_batches);
  r.bubble_ideal = parallel::simulate(parallel::make_schedule(pipe->options().schedule, D, S, M), S, M).bubble;
  r.balance = join(pipe->balance());
  return r;
}

}  // namespace

int run_bench_pipeline(const BenchConfig& c) {
  CHORUS_CHECK(c.precision == "fp32" || c.precision == "bf16", "unknown precision '", c.precision, "'");
  CHORUS_CHECK(c.batch_size > 0, "--batch-size must be positive, got ", c.batch_size);
  CHORUS_CHECK(c.steps > 0 && c.warmup >= 0, "--steps must be positive and --warmup >= 0");
  CHORUS_CHECK(c.micro_batches >= 1 && c.micro_batches <= c.batch_size, "--micro-batches must be from 1 to the batch (",
               c.batch_size, "), got ", c.micro_batches);
  (void)parallel::parse_checkpoint(c.recompute);
  if (c.balance) (void)parse_balance(*c.balance);
  const std::vector<std::string> names = split_list(c.schedules);
  CHORUS_CHECK(!names.empty(), "--schedules is empty (expected e.g. naive,gpipe,1f1b)");
  for (const std::string& n : names)
    if (n != "naive") (void)parallel::parse_schedule(n);
  const std::vector<Device> devs =
      c.devices.empty() ? parse_devices(cuda_device_count() >= 2 ? "all" : "cpu:0,cpu:1") : parse_devices(c.devices);
  CHORUS_CHECK(c.precision == "fp32" || devs[0].is_cuda(), "--precision bf16 needs a CUDA device");
  std::string dev_list;
  for (const Device& d : devs) dev_list += (dev_list.empty() ? "" : ",") + d.str();
  std::optional<std::string> balance = c.balance;
  // --bound: a pipeline keeps each of its D devices busy at most 1 - (ideal
  // bubble) of the step, each running micro-batches of B/M at the speed one
  // device runs them; naive model parallelism runs the whole batch B, one
  // device at a time. So a schedule can reach at most D * rate(B/M) *
  // (1 - ideal bubble) / naive over naive -- the 1.78x of 2 stages and 8
  // micro-batches only where a micro-batch runs as fast per sample as the
  // whole batch. The plain steps run on the first device, before the rows.
  double micro_rate = 0;
  if (c.bound) {
    const int64_t micro = std::max<int64_t>(1, c.batch_size / c.micro_batches);
    micro_rate = plain_step_rate(c, devs[0], micro);
    const double whole_rate = plain_step_rate(c, devs[0], c.batch_size);
    if (c.json) {
      nlohmann::ordered_json row = {{"model", c.model}, {"strategy", "plain"}, {"device_list", devs[0].str()},
                                    {"precision", c.precision}, {"micro_batch", micro}, {"micro_batch_img_per_s", micro_rate},
                                    {"batch", c.batch_size}, {"batch_img_per_s", whole_rate}};
      add_provenance(row, devs[0]);
      std::printf("%s\n", row.dump().c_str());
    } else {
      std::printf("%-10s plain steps on %s: batch %lld %.1f img/s, batch %lld %.1f img/s (%.2f per sample)\n",
                  c.model.c_str(), devs[0].str().c_str(), (long long)micro, micro_rate, (long long)c.batch_size,
                  whole_rate, whole_rate > 0 ? micro_rate / whole_rate : 0.0);
    }
  }
  double naive_rate = 0;
  for (const std::string& name : names) {
    const Row r = bench_schedule(c, devs, name, &balance);
    if (name == "naive") naive_rate = r.img_per_s;
    const double speedup = naive_rate > 0 ? r.img_per_s / naive_rate : 0;
    // The naive row's own micro-batch is the whole batch: no bound from micro_rate.
    const double bound = c.bound && naive_rate > 0 && name != "naive"
                             ? static_cast<double>(devs.size()) * micro_rate * (1.0 - r.bubble_ideal) / naive_rate
                             : -1;
    nlohmann::ordered_json peaks = nlohmann::ordered_json::array();
    for (size_t p : r.peaks) peaks.push_back(p);
    nlohmann::ordered_json row = {
        {"model", c.model},
        {"strategy", "pipeline"},
        {"schedule", name},
        {"micro_batches", name == "naive" ? int64_t{1} : c.micro_batches},
        {"balance", r.balance},
        {"recompute", c.recompute},
        {"devices", devs.size()},
        {"device_list", dev_list},
        {"precision", c.precision},
        {"channels_last", c.channels_last},
        {"batch", c.batch_size},
        {"batch_per_device", c.batch_size},
        {"img_per_s", r.img_per_s},
        {"step_ms", r.step_ms},
        {"peak_mem_bytes", *std::max_element(r.peaks.begin(), r.peaks.end())},
        {"peak_mem_bytes_per_device", peaks},
        {"cuda_graphs", r.graphed},
        {"bubble", r.bubble >= 0 ? nlohmann::ordered_json(r.bubble) : nullptr},
        {"bubble_ideal", r.bubble_ideal},
        {"speedup_vs_naive", naive_rate > 0 ? nlohmann::ordered_json(speedup) : nullptr},
        {"bound_vs_naive", bound >= 0 ? nlohmann::ordered_json(bound) : nullptr},
        {"loss", r.loss}};
    add_provenance(row, devs[0]);
    if (c.json) {
      std::printf("%s\n", row.dump().c_str());
    } else {
      std::string mem;
      for (size_t p : r.peaks) mem += (mem.empty() ? "" : " / ") + std::to_string(p >> 20);
      char bubble[32];
      if (r.bubble >= 0)
        std::snprintf(bubble, sizeof bubble, "%.3f", r.bubble);
      else
        std::snprintf(bubble, sizeof bubble, "-");
      std::printf("%-10s pipeline %-11s M=%-3lld %s  %5s  batch %-5lld %10.1f img/s %8.2f ms/step%s  bubble %s (ideal %.3f)"
                  "  peak %s MiB%s\n",
                  c.model.c_str(), name.c_str(), (long long)(name == "naive" ? 1 : c.micro_batches), dev_list.c_str(),
                  c.precision.c_str(), (long long)c.batch_size, r.img_per_s, r.step_ms, r.graphed ? " (graph)" : "",
                  bubble, r.bubble_ideal,
                  mem.c_str(),
                  naive_rate > 0 && name != "naive"
                      ? ("  " + std::to_string(speedup).substr(0, 4) + "x naive" +
                         (bound >= 0 ? " (bound " + std::to_string(bound).substr(0, 4) + "x)" : std::string()))
                            .c_str()
                      : "");
    }
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace chorus::app
