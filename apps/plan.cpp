// `chorus plan` (plan.h): the layouts table, and --calibrate.
#include "plan.h"

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <sstream>

#include <nlohmann/json.hpp>

#include "chorus/autograd/autocast.h"
#include "chorus/autograd/grad_mode.h"
#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/distributed/bus_bandwidth.h"
#include "chorus/distributed/init.h"
#include "chorus/distributed/launch_env.h"
#include "chorus/models/gpt.h"
#include "chorus/nn/functional.h"
#include "chorus/ops/factory.h"
#include "chorus/plan/calibration.h"
#include "chorus/plan/cost_model.h"
#include "cli_numbers.h"
#include "cli_options.h"
#include "commands.h"
#include "train_dist.h"
#include "train_gpt.h"

namespace chorus::app {

CLI::App* add_plan_command(CLI::App& app, PlanConfig& c) {
  CLI::App* cmd = app.add_subcommand(
      "plan", "Predict memory, step time, tok/s and MFU of a GPT's layouts on N GPUs (chorus plan --model gpt2-xl "
              "--gpus 64 --calibration FILE), or measure this device for it (--calibrate FILE)");
  cmd->add_option("--model", c.model, "gpt2|gpt2-medium|gpt2-large|gpt2-xl|d2..d84 (--calibrate: a list of name[:batch], e.g. gpt2:16,gpt2-xl,gpt2-xl:2,d84:4; batch defaults to --batch-size)")->capture_default_str();
  cmd->add_option("--gpus", c.gpus, "GPUs in the job")->capture_default_str()->transform(integer_up_to(1 << 24));
  cmd->add_option("--gpus-per-node", c.gpus_per_node, "GPUs a node (tensor parallelism stays inside one)")->capture_default_str()->transform(integer_up_to(1 << 16));
  cmd->add_option("--nic-gbps", c.nic_gbps, "Each GPU's network bandwidth across nodes, Gb/s")->capture_default_str()->check(real_number(1e6, false, 1e-3));
  cmd->add_option("--batch-size", c.batch, "Sequences a GPU a step (a mesh: batch x tp x pp a replica, in micro-batches)")->capture_default_str()->transform(integer_up_to(kMaxBatchSize));
  cmd->add_option("--seq-len", c.seq, "Tokens a sequence")->capture_default_str()->transform(integer_up_to(1 << 24));
  cmd->add_option("--precision", c.precision, "bf16|fp32")->capture_default_str();
  cmd->add_option("--zero-param-dtype", c.zero_param_dtype, "ZeRO rows: bf16 or fp32, the dtype the blocks' matrices are gathered in (default: bf16 under --precision bf16, as chorus train)");
  cmd->add_flag("--recompute", c.recompute, "Every block recomputes its activations in the backward (--recompute always)");
  add_optional(cmd, "--calibration", c.calibration, "The file chorus plan --calibrate wrote (without it: memory only)");
  add_optional(cmd, "--calibrate", c.calibrate, "Time this device's kernels at each --model's shapes (and, under chorus launch with 2+ ranks, the bus bandwidth) into FILE");
  add_optional(cmd, "--devices", c.devices, "--calibrate: cuda:0 or cpu (default: cuda:0 if present, else cpu; under a launcher the local rank's GPU)");
  add_optional(cmd, "--gpu-memory-gib", c.gpu_memory_gib, "Memory a GPU has for the plan (default: the calibrated device's, else 80)")->check(real_number(1e9, false, 0));
  cmd->add_option("--bus-sizes-mb", c.bus_sizes_mb, "--calibrate under a launcher: all-reduce sizes in MiB (default 1,16,64,256 on GPUs, 0.25,1,4 on CPUs)");
  cmd->add_option("--warmup", c.warmup, "--calibrate: untimed calls a kernel class")->capture_default_str()->check(CLI::Range(0, 1000));
  cmd->add_option("--iters", c.iters, "--calibrate: timed calls a kernel class")->capture_default_str()->check(CLI::Range(1, 100000));
  cmd->add_option("--top", c.top, "Rows printed, best first (0: all)")->capture_default_str()->transform(integer_up_to(1 << 20));
  cmd->add_flag("--json", c.json, "One JSON object per layout");
  return cmd;
}

namespace {

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(item);
  return out;
}

std::vector<int64_t> bus_sizes(const PlanConfig& c, bool cuda) {
  const std::string spec = !c.bus_sizes_mb.empty() ? c.bus_sizes_mb : cuda ? "1,16,64,256" : "0.25,1,4";
  std::vector<int64_t> out;
  for (const std::string& item : split_list(spec)) {
    double mb = 0;
    size_t used = 0;
    try {
      mb = std::stod(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    CHORUS_CHECK(used == item.size() && used > 0 && mb > 0 && mb <= 65536, "--bus-sizes-mb: '", item,
                 "' is not a size in MiB (0 < size <= 65536)");
    out.push_back(static_cast<int64_t>(mb * (1 << 20)) / 4 * 4);
  }
  CHORUS_CHECK(!out.empty(), "--bus-sizes-mb is empty");
  return out;
}

// "612.3 TFLOP/s", or GFLOP/s below a TFLOP/s (CPUs).
std::string flops_rate(double r) {
  char buf[48];
  if (r >= 1e12) std::snprintf(buf, sizeof buf, "%.1f TFLOP/s", r / 1e12);
  else std::snprintf(buf, sizeof buf, "%.2f GFLOP/s", r / 1e9);
  return buf;
}

// "CUDA graph / eager: block 0.93, classifier 0.99, AdamW 0.71", the pieces
// not captured left out ("no CUDA graph timed" when none was).
std::string graph_ratios(const plan::ModelTiming& t) {
  const plan::KernelRates k = t.rates();
  std::string s;
  char buf[48];
  auto add = [&](const char* name, bool timed, double r) {
    if (!timed) return;
    std::snprintf(buf, sizeof buf, "%s%s %.3f", s.empty() ? "" : ", ", name, r);
    s += buf;
  };
  add("block", t.graph_block.has_value(), k.graph_block);
  add("classifier", t.graph_classifier.has_value(), k.graph_classifier);
  add("AdamW", t.graph_optimizer.has_value(), k.graph_optimizer);
  return s.empty() ? "no CUDA graph timed" : "CUDA graph / eager: " + s;
}

int run_calibrate(const PlanConfig& c) {
  CHORUS_CHECK(c.precision == "bf16" || c.precision == "fp32", "--precision must be bf16 or fp32, got '",
               c.precision, "'");
  // name[:batch] items: one timing a model and micro-batch (Note [Calibration]).
  struct ToTime {
    std::string name;
    models::GPTConfig cfg;
    int64_t batch = 0;
  };
  std::vector<ToTime> models_to_time;
  for (const std::string& item : split_list(c.model)) {
    const size_t colon = item.find(':');
    ToTime m{item.substr(0, colon), {}, c.batch};
    if (colon != std::string::npos) {
      const std::string b = item.substr(colon + 1);
      const bool digits = !b.empty() && b.size() <= 9 && b.find_first_not_of("0123456789") == std::string::npos;
      CHORUS_CHECK(digits && std::stoll(b) >= 1, "--model: '", item, "' is not name[:batch] with a batch of at least 1");
      m.batch = std::stoll(b);
    }
    m.cfg = models::GPTConfig::named(m.name);
    CHORUS_CHECK(c.seq <= m.cfg.context, "--seq-len ", c.seq, " exceeds ", m.name, "'s context of ", m.cfg.context);
    models_to_time.push_back(m);
  }
  CHORUS_CHECK(!models_to_time.empty(), "--model is empty: name the models to time, e.g. --model gpt2,gpt2-xl");
  // Under a launcher with 2+ ranks every rank all-reduces on its local
  // rank's device (as chorus train --strategy ddp picks it: --devices cuda
  // or the default on a GPU machine is the local rank's GPU); rank 0 then
  // times the kernels.
  const std::optional<dist::LaunchEnv> env = dist::read_launch_env();
  const bool bus = env && env->world_size >= 2;
  dist::ProcessGroupPtr pg;
  Device device = c.devices ? Device(*c.devices) : (cuda_is_available() ? cuda_device(0) : cpu_device(0));
  if (bus) {
    const std::vector<Device> mine = ddp_devices(c.devices.value_or(""), *env);
    CHORUS_CHECK(mine.size() == 1, "chorus plan --calibrate under a launcher takes one device per process, got --devices ",
                 c.devices.value_or(""));
    device = mine[0];
    pg = join_job(*env, device, 300).group;
  }
  CHORUS_CHECK(c.precision == "fp32" || device.is_cuda(), "--precision bf16 is timed on GPUs; calibrate ",
               device.str(), " with --precision fp32");
  const bool bf16 = c.precision == "bf16";

  plan::Calibration cal;
  cal.device = device.str();
  cal.device_name = backend(device).device_name(device);
  cal.commit = git_commit();
  cal.precision = c.precision;
  cal.peak_flops = device.is_cuda() ? bf16_peak_flops(cal.device_name) : 0.0;
  if (auto info = backend(device).memory_info(device)) cal.memory_bytes = static_cast<int64_t>(info->total);
  if (bus) {
    std::vector<std::pair<int64_t, double>> rows;
    for (int64_t bytes : bus_sizes(c, device.is_cuda()))
      rows.emplace_back(bytes, dist::time_all_reduce(*pg, device, bytes, 3, 10));
    // Note [Cost model]'s overlap slowdown: the first model's MLP GEMM
    // (N x C by C x 4C, four of them) beside all-reduces of the largest size.
    double slowdown = 0;
    {
      const ToTime& m = models_to_time.front();
      const int64_t n = m.batch * c.seq, w = m.cfg.width;
      std::optional<AutocastGuard> cast;
      if (bf16) cast.emplace(kBFloat16);
      const Tensor x = randn({n, w}, TensorOptions(kFloat32, device));
      const Tensor weight = randn({4 * w, w}, TensorOptions(kFloat32, device));
      NoGradGuard no_grad;
      slowdown = dist::slowdown_beside_all_reduce(
          *pg, device, [&] { for (int i = 0; i < 4; ++i) nn::functional::linear(x, weight, Tensor()); },
          rows.back().first, std::max(c.iters, 3));
    }
    if (pg->rank() != 0) return 0;
    cal.bus = plan::fit_bus_bandwidth(pg->size(), rows);
    cal.bus->overlap_slowdown = slowdown;
    std::fprintf(stderr, "bus bandwidth over %d ranks (%s): %.1f GB/s, latency %.1f us; a GEMM beside all-reduces "
                 "runs x%.3f\n", pg->size(), device.is_cuda() ? "nccl" : "gloo", cal.bus->busbw / 1e9,
                 cal.bus->latency_s * 1e6, slowdown);
  }
  for (const ToTime& m : models_to_time) {
    plan::ModelTiming t = plan::time_gpt_kernels(m.name, m.cfg, device, m.batch, c.seq, bf16, c.warmup, c.iters);
    const plan::KernelRates k = t.rates();
    std::fprintf(stderr, "%s on %s (%s), %lld tokens: gemm %s, attention %s, classifier %s, block %.2f ms (other %.2f ms), "
                 "AdamW %.3g Gparam/s; recompute x%.3f; %s\n",
                 m.name.c_str(), cal.device_name.c_str(), cal.precision.c_str(), static_cast<long long>(t.tokens),
                 flops_rate(t.gemm.rate).c_str(), flops_rate(t.attention.rate).c_str(),
                 flops_rate(t.classifier.rate).c_str(), t.block.seconds * 1e3, t.other.seconds * 1e3,
                 t.optimizer.rate / 1e9, k.recompute, graph_ratios(t).c_str());
    cal.models.push_back(t);
  }
  plan::write_calibration(*c.calibrate, cal);
  std::printf("calibration written to %s (%s, %s, commit %s)\n", c.calibrate->c_str(), cal.device_name.c_str(),
              cal.precision.c_str(), cal.commit.c_str());
  return 0;
}

std::string opt_fixed(const std::optional<double>& v, double scale, const char* fmt) {
  if (!v) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, *v * scale);
  return buf;
}

}  // namespace

int run_plan(const PlanConfig& c) {
  CHORUS_CHECK(!(c.calibrate && c.calibration), "--calibrate writes a calibration and --calibration reads one: give one");
  if (c.calibrate) return run_calibrate(c);
  CHORUS_CHECK(c.model.find(',') == std::string::npos, "--model names one model to plan (a list is for --calibrate)");
  CHORUS_CHECK(c.precision == "bf16" || c.precision == "fp32", "--precision must be bf16 or fp32, got '",
               c.precision, "'");
  plan::Job job;
  job.cfg = models::GPTConfig::named(c.model);
  job.cfg.recompute_blocks = c.recompute ? job.cfg.layers : 0;
  job.gpus = c.gpus;
  job.gpus_per_node = c.gpus_per_node;
  job.batch = c.batch;
  job.seq = c.seq;
  job.bf16 = c.precision == "bf16";
  job.zero_param_dtype = c.zero_param_dtype;
  plan::validate(job);

  std::optional<plan::Calibration> cal;
  std::optional<plan::Rates> rates;
  std::string calibrated_line, rates_of;
  bool rates_exact = false;
  if (c.calibration) {
    cal = plan::read_calibration(*c.calibration);
    CHORUS_CHECK(cal->precision == c.precision, "calibration ", *c.calibration, " was measured in ", cal->precision,
                 ", not --precision ", c.precision, ": calibrate again with --precision ", c.precision);
    bool exact = false;
    const plan::ModelTiming& t = plan::timing_for(*cal, job.cfg, job.seq, &exact, job.batch * job.seq);
    rates = plan::rates_for(*cal, t);
    rates_of = t.model;
    rates_exact = exact;
    std::string tokens = std::to_string(t.tokens);
    for (const plan::KernelRates& k : rates->more) tokens += ", " + std::to_string(k.tokens);
    char ratios[96];
    std::snprintf(ratios, sizeof ratios, "recompute x%.3f", rates->kernels.recompute);
    calibrated_line = "calibration " + *c.calibration + ": " + cal->device_name + ", " + cal->precision + ", commit " +
                      cal->commit + "; kernels timed at " + t.model + "'s shapes" +
                      (exact ? "" : " (not " + c.model + "'s: its rates stand in)") + " (" + tokens + " tokens); " +
                      (cal->version < 2 ? "version 1: recompute x4/3 and no CUDA graph timings assumed"
                                        : std::string(ratios) + ", " + graph_ratios(t));
    if (cal->bus) {
      plan::Links l;
      l.nvlink_busbw = cal->bus->busbw;
      l.latency_s = cal->bus->latency_s;
      if (cal->bus->overlap_slowdown > 0) l.overlap_slowdown = cal->bus->overlap_slowdown;
      l.nic_bw = c.nic_gbps * 1e9 / 8;
      l.gpus_per_node = c.gpus_per_node;
      rates->links = l;
      char buf[224];
      std::snprintf(buf, sizeof buf,
                    "; bus bandwidth %.1f GB/s over %lld ranks, latency %.1f us, compute beside it x%.3f%s; NIC %.0f Gb/s a GPU",
                    l.nvlink_busbw / 1e9, static_cast<long long>(cal->bus->ranks), l.latency_s * 1e6,
                    l.overlap_slowdown, cal->bus->overlap_slowdown > 0 ? "" : " (not measured)", c.nic_gbps);
      calibrated_line += buf;
    } else {
      calibrated_line += "; no bus bandwidth measured (calibrate under chorus launch with 2+ ranks): no times for "
                         "more than one GPU";
    }
  }
  const double mem_gib = c.gpu_memory_gib ? *c.gpu_memory_gib
                         : cal && cal->memory_bytes > 0 ? static_cast<double>(cal->memory_bytes) / (1 << 30)
                                                        : 80.0;
  job.gpu_memory_bytes = static_cast<int64_t>(mem_gib * static_cast<double>(int64_t{1} << 30));
  const std::vector<plan::Prediction> rows = plan::plan_layouts(job, rates);
  const bool timed = !rows.empty() && rows.front().step_s.has_value();

  if (c.json) {
    for (const plan::Prediction& p : rows) {
      auto num = [](const std::optional<double>& v) { return v ? nlohmann::ordered_json(*v) : nlohmann::ordered_json(nullptr); };
      nlohmann::ordered_json j = {{"model", c.model}, {"gpus", c.gpus}, {"layout", p.layout.name()},
                                  {"flags", p.layout.flags()}, {"dp", p.layout.dp}, {"tp", p.layout.tp},
                                  {"pp", p.layout.pp}, {"micro_batches", p.layout.micro_batches},
                                  {"virtual_stages", p.layout.virtual_stages},
                                  {"memory_bytes", p.memory.total()}, {"needed_bytes", p.memory.needed()},
                                  {"fits", p.fits}, {"step_s", num(p.step_s)}, {"tok_per_s", num(p.tok_s)},
                                  {"mfu", num(p.mfu)}, {"exposed_comm_s", num(p.exposed_comm_s)},
                                  {"bubble", num(p.bubble)}, {"calibrated", rates.has_value()}};
      if (rates) {
        j["rates_of"] = rates_of;
        j["rates_exact"] = rates_exact;
      }
      std::printf("%s\n", j.dump().c_str());
    }
    return 0;
  }
  const int64_t nodes = (c.gpus + c.gpus_per_node - 1) / c.gpus_per_node;
  std::printf("chorus plan: %s (%.1fM parameters), %lld GPU%s (%lld node%s of up to %lld), %lld x %lld tokens a GPU, %s%s\n",
              c.model.c_str(), static_cast<double>(job.cfg.num_parameters()) / 1e6, static_cast<long long>(c.gpus),
              c.gpus == 1 ? "" : "s",
              static_cast<long long>(nodes), nodes == 1 ? "" : "s", static_cast<long long>(c.gpus_per_node),
              static_cast<long long>(c.batch), static_cast<long long>(c.seq), c.precision.c_str(),
              c.recompute ? ", --recompute" : "");
  if (cal) {
    std::printf("%s\n", calibrated_line.c_str());
  } else {
    std::printf("uncalibrated: memory only; step time, tok/s and MFU need --calibration FILE "
                "(chorus plan --calibrate FILE on the GPU)\n");
  }
  std::printf("memory: the plan per GPU (Note [Memory plan formulas]); fits: needed (with reserve) <= %.1f GiB%s\n",
              mem_gib, c.gpu_memory_gib ? " (--gpu-memory-gib)" : cal && cal->memory_bytes > 0 ? " (the calibrated device's)" : " (assumed: --gpu-memory-gib)");
  std::printf("%-2s %-26s %9s %9s %5s %10s %12s %7s %9s %7s  %s\n", "", "layout", "plan GiB", "need GiB", "fits",
              "step ms", "tok/s", "MFU", "comm ms", "bubble", "flags");
  const size_t shown = c.top == 0 ? rows.size() : std::min(rows.size(), static_cast<size_t>(c.top));
  for (size_t i = 0; i < shown; ++i) {
    const plan::Prediction& p = rows[i];
    const bool best = timed && i == 0 && p.fits;
    std::printf("%-2s %-26s %9s %9s %5s %10s %12s %7s %9s %7s  %s\n", best ? "*" : "", p.layout.name().c_str(),
                dist::gib(p.memory.total()).c_str(), dist::gib(p.memory.needed()).c_str(), p.fits ? "yes" : "NO",
                opt_fixed(p.step_s, 1e3, "%.1f").c_str(), opt_fixed(p.tok_s, 1, "%.0f").c_str(),
                opt_fixed(p.mfu, 100, "%.1f%%").c_str(), opt_fixed(p.exposed_comm_s, 1e3, "%.1f").c_str(),
                opt_fixed(p.bubble, 100, "%.1f%%").c_str(), p.layout.flags().c_str());
  }
  if (shown < rows.size())
    std::printf("%zu more layouts (--top 0 lists them all)\n", rows.size() - shown);
  if (timed && rows.front().fits) std::printf("best: %s (%s)\n", rows.front().layout.name().c_str(), rows.front().layout.flags().c_str());
  else if (timed) std::printf("no layout fits %.1f GiB a GPU: --recompute or a smaller --batch-size\n", mem_gib);
  return 0;
}

}  // namespace chorus::app
