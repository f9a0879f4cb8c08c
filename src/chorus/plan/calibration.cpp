#include "chorus/plan/calibration.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <limits>

#include <nlohmann/json.hpp>

#include "chorus/autograd/autocast.h"
#include "chorus/autograd/functions.h"
#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/core/warn.h"
#include "chorus/io/file_util.h"
#include "chorus/nn/functional.h"
#include "chorus/nn/layers.h"
#include "chorus/ops/factory.h"
#include "chorus/optim/adamw.h"
#include "chorus/optim/clip_grad.h"
#include "chorus/nn/checkpoint.h"
#include "chorus/parallel/graphed_step.h"

namespace chorus::plan {

namespace {

using cjson = nlohmann::ordered_json;

constexpr const char* kCalibrationFormat = "chorus-plan-calibration";
constexpr int kCalibrationVersion = 2;  // 1: before recompute and graph timings (still read)

ClassTiming timing_of(double seconds, double work) {
  return {seconds, work, seconds > 0 ? work / seconds : 0.0};
}

// Seconds per call of f, after `warmup` calls, the device drained before and after.
template <class F>
double seconds_per_call(const Device& d, int warmup, int iters, F&& f) {
  for (int i = 0; i < warmup; ++i) f();
  synchronize(d);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) f();
  synchronize(d);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
}

// Seconds per replay of f captured as one CUDA graph (Note [Graphed step]:
// one eager call, the capture, then replays; `warmup` covers the first two),
// unset on a device without graphs or when f cannot be captured (said on
// stderr, naming `what`).
template <class F>
std::optional<double> seconds_per_replay(const char* what, const Device& d, int warmup, int iters, F&& f) {
  if (!d.is_cuda()) return std::nullopt;
  bool fell_back = false;
  parallel::GraphedStepOptions o;
  o.warmup_steps = 1;
  o.on_fallback = [&](const std::string& line) {
    fell_back = true;
    warn(std::string("chorus plan --calibrate: the ") + what + " timed eagerly only: " + line);
  };
  parallel::GraphedStep graphed(
      [&](const std::vector<Tensor>&) {
        f();
        return std::vector<Tensor>{};
      },
      o);
  const Tensor trigger = zeros({1}, TensorOptions(kFloat32, d));  // the graph's one (unused) input
  const double s = seconds_per_call(d, std::max(warmup, 2), iters, [&] { graphed({trigger}); });
  if (fell_back || !graphed.captured() || graphed.replays() < iters) return std::nullopt;
  return s;
}

cjson class_json(const ClassTiming& t, const char* work) {
  return cjson{{"seconds", t.seconds}, {work, t.work}, {"rate", t.rate}};
}

// A field of `j` that must be a finite number (positive unless zero_ok).
double number(const cjson& j, const std::string& key, const std::string& where, bool zero_ok = false) {
  CHORUS_CHECK(j.is_object() && j.contains(key), "calibration ", where, ": '", key, "' is missing");
  const cjson& v = j.at(key);
  CHORUS_CHECK(v.is_number() && std::isfinite(v.get<double>()) && (v.get<double>() > 0 || (zero_ok && v.get<double>() == 0)),
               "calibration ", where, ": '", key, "' must be a ", zero_ok ? "non-negative" : "positive", " number");
  return v.get<double>();
}

std::string text(const cjson& j, const std::string& key, const std::string& where) {
  CHORUS_CHECK(j.is_object() && j.contains(key) && j.at(key).is_string(), "calibration ", where, ": '", key,
               "' is missing or not a string");
  return j.at(key).get<std::string>();
}

ClassTiming class_from(const cjson& j, const std::string& name, const char* work, const std::string& where,
                       bool zero_ok) {
  CHORUS_CHECK(j.contains(name) && j.at(name).is_object(), "calibration ", where, ": class '", name, "' is missing");
  const std::string w = where + " " + name;
  ClassTiming t;
  t.seconds = number(j.at(name), "seconds", w, zero_ok);
  t.work = number(j.at(name), work, w);
  t.rate = number(j.at(name), "rate", w, zero_ok);
  return t;
}

}  // namespace

KernelRates ModelTiming::rates() const {
  KernelRates k;
  k.width = width;
  k.heads = heads;
  k.seq = seq;
  k.tokens = tokens;
  k.gemm_flops = gemm.rate;
  k.attention_flops = attention.rate;
  k.classifier_flops = classifier.rate;
  k.other_elements = other.rate;
  k.optimizer_params = optimizer.rate;
  for (const auto& [tp, t] : gemm_shards) k.gemm_flops_shards.emplace_back(tp, t.rate);
  if (recompute.seconds > 0) k.recompute = recompute.seconds / block.seconds;
  if (graph_block) k.graph_block = graph_block->seconds / block.seconds;
  if (graph_classifier) k.graph_classifier = graph_classifier->seconds / classifier.seconds;
  if (graph_optimizer) k.graph_optimizer = graph_optimizer->seconds / optimizer.seconds;
  return k;
}

Rates rates_for(const Calibration& cal, const ModelTiming& chosen) {
  Rates r;
  r.kernels = chosen.rates();
  for (const ModelTiming& m : cal.models)
    if (&m != &chosen && m.width == chosen.width && m.heads == chosen.heads && m.seq == chosen.seq)
      r.more.push_back(m.rates());
  r.peak_flops = cal.peak_flops;
  return r;
}

const ModelTiming& timing_for(const Calibration& cal, const models::GPTConfig& cfg, int64_t seq, bool* exact,
                              int64_t tokens) {
  CHORUS_CHECK(!cal.models.empty(), "the calibration holds no kernel timings");
  const ModelTiming* best = nullptr;
  double best_distance = std::numeric_limits<double>::infinity();
  for (const ModelTiming& m : cal.models) {
    // The nearest width in ratio; the same sequence length breaks ties, then
    // the nearest tokens (a smaller term than any width's or seq's step).
    const double d = std::abs(std::log(static_cast<double>(m.width) / static_cast<double>(cfg.width))) +
                     (m.seq == seq ? 0.0 : 1e-3) +
                     (tokens > 0 ? 1e-6 * std::abs(std::log(static_cast<double>(m.tokens) / static_cast<double>(tokens)))
                                 : 0.0);
    if (d < best_distance) best_distance = d, best = &m;
  }
  if (exact) *exact = best->width == cfg.width && best->heads == cfg.heads && best->seq == seq;
  return *best;
}

std::string calibration_json(const Calibration& cal) {
  cjson j = {{"format", kCalibrationFormat},     {"version", cal.version},
             {"device", cal.device},             {"device_name", cal.device_name},
             {"commit", cal.commit},             {"precision", cal.precision},
             {"peak_flops", cal.peak_flops},     {"memory_bytes", cal.memory_bytes}};
  cjson models = cjson::array();
  for (const ModelTiming& m : cal.models) {
    models.push_back({{"model", m.model},
                      {"width", m.width},
                      {"heads", m.heads},
                      {"seq", m.seq},
                      {"tokens", m.tokens},
                      {"padded_vocab", m.padded_vocab},
                      {"gemm", class_json(m.gemm, "flops")},
                      {"attention", class_json(m.attention, "flops")},
                      {"classifier", class_json(m.classifier, "flops")},
                      {"other", class_json(m.other, "elements")},
                      {"optimizer", class_json(m.optimizer, "params")},
                      {"block", class_json(m.block, "flops")}});
    if (cal.version >= 2) models.back()["recompute"] = class_json(m.recompute, "flops");
    cjson graph = cjson::object();
    if (m.graph_block) graph["block"] = class_json(*m.graph_block, "flops");
    if (m.graph_classifier) graph["classifier"] = class_json(*m.graph_classifier, "flops");
    if (m.graph_optimizer) graph["optimizer"] = class_json(*m.graph_optimizer, "params");
    if (cal.version >= 2 && !graph.empty()) models.back()["graph"] = graph;
    cjson shards = cjson::array();
    for (const auto& [tp, t] : m.gemm_shards) {
      cjson one = class_json(t, "flops");
      one["tp"] = tp;
      shards.push_back(one);
    }
    models.back()["gemm_shards"] = shards;
  }
  j["models"] = models;
  if (cal.bus) {
    cjson rows = cjson::array();
    for (const auto& [bytes, s] : cal.bus->rows) rows.push_back({{"bytes", bytes}, {"seconds", s}});
    j["bus"] = {{"ranks", cal.bus->ranks},
                {"busbw_GBs", cal.bus->busbw / 1e9},
                {"latency_us", cal.bus->latency_s * 1e6},
                {"rows", rows}};
    if (cal.version >= 2 && cal.bus->overlap_slowdown > 0) j["bus"]["overlap_slowdown"] = cal.bus->overlap_slowdown;
  }
  return j.dump(2) + "\n";
}

Calibration parse_calibration(const std::string& body, const std::string& where) {
  cjson j;
  try {
    j = cjson::parse(body);
  } catch (const std::exception&) {
    CHORUS_THROW(ValueError, "calibration ", where, " is not JSON (write one with chorus plan --calibrate FILE)");
  }
  CHORUS_CHECK(j.is_object() && j.contains("format") && j.at("format").is_string() &&
                   j.at("format").get<std::string>() == kCalibrationFormat, "calibration ", where,
               " is not a chorus plan calibration (its \"format\" is not \"", kCalibrationFormat, "\")");
  const int version = j.contains("version") && j.at("version").is_number_integer() ? j.at("version").get<int>() : 0;
  CHORUS_CHECK(version == 1 || version == kCalibrationVersion, "calibration ", where, ": version ", version,
               " is not a version this chorus reads (1 or ", kCalibrationVersion, ")");
  Calibration cal;
  cal.version = version;
  cal.device = text(j, "device", where);
  cal.device_name = text(j, "device_name", where);
  cal.commit = text(j, "commit", where);
  cal.precision = text(j, "precision", where);
  CHORUS_CHECK(cal.precision == "bf16" || cal.precision == "fp32", "calibration ", where, ": precision '",
               cal.precision, "' is not bf16 or fp32");
  cal.peak_flops = number(j, "peak_flops", where, true);
  cal.memory_bytes = static_cast<int64_t>(number(j, "memory_bytes", where, true));
  CHORUS_CHECK(j.contains("models") && j.at("models").is_array() && !j.at("models").empty(), "calibration ", where,
               ": 'models' is missing or empty");
  for (const cjson& m : j.at("models")) {
    ModelTiming t;
    t.model = text(m, "model", where);
    const std::string w = where + " (" + t.model + ")";
    t.width = static_cast<int64_t>(number(m, "width", w));
    t.heads = static_cast<int64_t>(number(m, "heads", w));
    t.seq = static_cast<int64_t>(number(m, "seq", w));
    t.tokens = static_cast<int64_t>(number(m, "tokens", w));
    t.padded_vocab = static_cast<int64_t>(number(m, "padded_vocab", w));
    t.gemm = class_from(m, "gemm", "flops", w, false);
    t.attention = class_from(m, "attention", "flops", w, false);
    t.classifier = class_from(m, "classifier", "flops", w, false);
    t.other = class_from(m, "other", "elements", w, true);
    t.optimizer = class_from(m, "optimizer", "params", w, false);
    t.block = class_from(m, "block", "flops", w, false);
    if (version >= 2) {
      t.recompute = class_from(m, "recompute", "flops", w, false);
      if (m.contains("graph")) {
        const cjson& g = m.at("graph");
        CHORUS_CHECK(g.is_object(), "calibration ", w, ": 'graph' is not an object");
        if (g.contains("block")) t.graph_block = class_from(g, "block", "flops", w + " graph", false);
        if (g.contains("classifier")) t.graph_classifier = class_from(g, "classifier", "flops", w + " graph", false);
        if (g.contains("optimizer")) t.graph_optimizer = class_from(g, "optimizer", "params", w + " graph", false);
      }
    }
    if (m.contains("gemm_shards")) {
      CHORUS_CHECK(m.at("gemm_shards").is_array(), "calibration ", w, ": 'gemm_shards' is not a list");
      for (const cjson& one : m.at("gemm_shards")) {
        const int64_t tp = static_cast<int64_t>(number(one, "tp", w + " gemm_shards"));
        t.gemm_shards.emplace_back(tp, class_from(cjson{{"shard", one}}, "shard", "flops", w + " gemm_shards", false));
      }
    }
    cal.models.push_back(t);
  }
  if (j.contains("bus")) {
    const cjson& b = j.at("bus");
    BusBandwidth bus;
    bus.ranks = static_cast<int64_t>(number(b, "ranks", where + " bus"));
    bus.busbw = number(b, "busbw_GBs", where + " bus") * 1e9;
    bus.latency_s = number(b, "latency_us", where + " bus", true) * 1e-6;
    if (version >= 2 && b.contains("overlap_slowdown")) bus.overlap_slowdown = number(b, "overlap_slowdown", where + " bus");
    CHORUS_CHECK(b.contains("rows") && b.at("rows").is_array(), "calibration ", where, " bus: 'rows' is missing");
    for (const cjson& r : b.at("rows"))
      bus.rows.emplace_back(static_cast<int64_t>(number(r, "bytes", where + " bus row")),
                            number(r, "seconds", where + " bus row"));
    cal.bus = bus;
  }
  return cal;
}

void write_calibration(const std::string& path, const Calibration& cal) {
  io::detail::write_file_atomically(path, calibration_json(cal));
}

Calibration read_calibration(const std::string& path) {
  std::error_code ec;
  CHORUS_CHECK(std::filesystem::is_regular_file(path, ec), "calibration file ", path,
               " does not exist or is not a file (write one with chorus plan --calibrate FILE)");
  return parse_calibration(io::detail::read_file(path), path);
}

ModelTiming time_gpt_kernels(const std::string& model, const models::GPTConfig& cfg, const Device& device,
                             int64_t batch, int64_t seq, bool bf16, int warmup, int iters,
                             const std::vector<int64_t>& shards) {
  CHORUS_CHECK(batch >= 1 && seq >= 1 && seq <= cfg.context && iters >= 1 && warmup >= 0,
               "kernel timing needs batch, seq (up to the context) and iterations of at least 1");
  DeviceGuard on(device);
  std::optional<AutocastGuard> cast;
  if (bf16) cast.emplace(kBFloat16);
  const int64_t n = batch * seq, c = cfg.width, h = cfg.heads, vp = cfg.padded_vocab;
  const double N = static_cast<double>(n), C = static_cast<double>(c), T = static_cast<double>(seq);
  const TensorOptions f32(kFloat32, device);
  const DType compute = bf16 ? kBFloat16 : kFloat32;
  ModelTiming t;
  t.model = model;
  t.width = c;
  t.heads = h;
  t.seq = seq;
  t.tokens = n;
  t.padded_vocab = vp;

  // The four matrices of a block, each forward and backward on its own
  // input, whole and split tp ways (column-parallel by output, row-parallel
  // by input).
  auto time_matrices = [&](int64_t tp) {
    double sum = 0;
    for (auto [in, out] : {std::pair{c, 3 * c / tp}, std::pair{c / tp, c}, std::pair{c, 4 * c / tp},
                           std::pair{4 * c / tp, c}}) {
      nn::Linear lin(in, out);
      lin.to(device);
      Tensor x = randn({n, in}, f32).requires_grad_();
      sum += seconds_per_call(device, warmup, iters, [&] {
        Tensor y = lin.forward(x);
        y.backward(ones_like(y));
        lin.zero_grad();
        x.zero_grad();
      });
    }
    return timing_of(sum, 72 * N * C * C / static_cast<double>(tp));
  };
  t.gemm = time_matrices(1);
  for (int64_t tp : shards)
    if (tp > 1 && h % tp == 0) t.gemm_shards.emplace_back(tp, time_matrices(tp));

  // Attention as the block runs it: q, k, v views of one [B, T, 3C] tensor
  // in the compute dtype, [B, H, T, D] through the autograd function.
  {
    Tensor qkv = randn({batch, seq, 3 * c}, TensorOptions(compute, device)).requires_grad_();
    const double s = seconds_per_call(device, warmup, iters, [&] {
      Tensor y = nn::functional::causal_self_attention(qkv, h, 0.0, cfg.attention);
      y.backward(ones_like(y));
      qkv.zero_grad();
    });
    t.attention = timing_of(s, 6 * N * C * T);
  }

  // The tied classifier: logits of the padded vocabulary and the fused loss.
  {
    Tensor x = randn({n, c}, f32).requires_grad_();
    Tensor w = randn({vp, c}, f32).mul(0.02).requires_grad_();
    Tensor targets = randint(0, cfg.vocab, {n}, TensorOptions(kInt64, device));
    auto run = [&] {
      Tensor loss = nn::functional::cross_entropy_fused(nn::functional::linear(x, w, Tensor()), targets, cfg.vocab);
      loss.backward();
      x.zero_grad();
      w.zero_grad();
    };
    const double flops = 6 * N * C * static_cast<double>(vp);
    t.classifier = timing_of(seconds_per_call(device, warmup, iters, run), flops);
    if (auto g = seconds_per_replay("classifier", device, warmup, iters, run)) t.graph_classifier = timing_of(*g, flops);
  }

  // A whole block; what it takes beyond its matrices and attention is "other".
  models::GPTConfig one = cfg;
  one.layers = 1;
  models::GPTBlock block(one);
  block.to(device);
  Tensor x = randn({batch, seq, c}, f32).requires_grad_();
  {
    const double flops = 72 * N * C * C + 6 * N * C * T;
    auto run = [&](bool recompute) {
      return [&block, &x, recompute] {
        Tensor y = recompute ? nn::checkpoint(block, x) : block.forward(x);
        y.backward(ones_like(y));
        block.zero_grad();
        x.zero_grad();
      };
    };
    const double s = seconds_per_call(device, warmup, iters, run(false));
    t.block = timing_of(s, flops);
    const double rest = s - t.gemm.seconds - t.attention.seconds;
    t.other = rest > 0 ? timing_of(rest, N * C) : ClassTiming{0, N * C, 0};
    // --recompute as it runs: the checkpointed block, eagerly (the layouts
    // that recompute to fit are mostly ZeRO-3's, which are eager).
    t.recompute = timing_of(seconds_per_call(device, warmup, iters, run(true)), flops);
    if (auto g = seconds_per_replay("block", device, warmup, iters, run(false))) t.graph_block = timing_of(*g, flops);
  }
  {
    // AdamW as chorus train steps: the clip folded into the update, the
    // gradients kept (the step reads them each call).
    Tensor y = block.forward(x);
    y.backward(ones_like(y));
    std::vector<Tensor> params = block.parameters();
    double count = 0;
    for (const Tensor& p : params) count += static_cast<double>(p.numel());
    optim::AdamW opt(params, optim::AdamWOptions{1e-4, 0.9, 0.95, 1e-8, 0.1, {}});
    auto run = [&] { optim::clip_and_step(opt, params, 1.0); };
    t.optimizer = timing_of(seconds_per_call(device, warmup, iters, run), count);
    if (auto g = seconds_per_replay("optimizer", device, warmup, iters, run)) t.graph_optimizer = timing_of(*g, count);
  }
  return t;
}

BusBandwidth fit_bus_bandwidth(int64_t ranks, const std::vector<std::pair<int64_t, double>>& rows) {
  CHORUS_CHECK(ranks >= 2, "a bus bandwidth needs at least 2 ranks, got ", ranks);
  CHORUS_CHECK(!rows.empty(), "a bus bandwidth needs at least one measured all-reduce");
  const double f = 2.0 * static_cast<double>(ranks - 1) / static_cast<double>(ranks);
  BusBandwidth b;
  b.ranks = ranks;
  b.rows = rows;
  // t = a + x / busbw with x = f * bytes: ordinary least squares in (x, t).
  double sx = 0, st = 0, sxx = 0, sxt = 0;
  for (const auto& [bytes, s] : rows) {
    const double x = f * static_cast<double>(bytes);
    sx += x, st += s, sxx += x * x, sxt += x * s;
  }
  const double k = static_cast<double>(rows.size());
  const double denom = k * sxx - sx * sx;
  double slope = denom > 0 ? (k * sxt - sx * st) / denom : 0.0;
  double a = denom > 0 ? (st - slope * sx) / k : 0.0;
  if (slope <= 0 || a < 0) {
    // One size, or sizes too noisy for two parameters: no latency, the
    // bandwidth of the largest.
    const auto& [bytes, s] = *std::max_element(rows.begin(), rows.end());
    a = 0;
    slope = s / (f * static_cast<double>(bytes));
  }
  CHORUS_CHECK(slope > 0 && std::isfinite(slope), "the measured all-reduces give no bandwidth");
  b.busbw = 1.0 / slope;
  b.latency_s = a;
  return b;
}

}  // namespace chorus::plan
