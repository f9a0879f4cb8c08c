// `chorus bench --model gpt2|...|dN`: a GPT's training throughput on random
// token ids on one device -- tokens/s, MFU (llm.c's FLOP count) and peak
// memory -- with the step `chorus train` runs (gpt_forward_backward, global
// clipping, AdamW with its parameter groups), timed after a warm-up.
#include <chrono>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "bench.h"
#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/core/rng.h"
#include "chorus/models/gpt.h"
#include "chorus/ops/factory.h"
#include "chorus/optim/adamw.h"
#include "chorus/optim/clip_grad.h"
#include "chorus/parallel/graphed_step.h"
#include "train_gpt.h"

namespace chorus::app {

int run_bench_gpt(const BenchConfig& c) {
  CHORUS_CHECK(c.strategy == "single", "chorus bench --model ", c.model, ": --strategy ", c.strategy,
               " is not offered for GPT models yet (single; chorus train --strategy ddp trains them over processes)");
  CHORUS_CHECK(c.precision == "fp32" || c.precision == "bf16", "unknown precision '", c.precision, "'");
  CHORUS_CHECK(c.batch_size > 0 && c.steps > 0 && c.warmup >= 0, "--batch-size and --steps must be positive");
  const int64_t seq = c.seq_len > 0 ? c.seq_len : 1024;
  const Device dev = c.devices.empty() ? (cuda_is_available() ? cuda_device(0) : cpu_device(0)) : Device(c.devices);
  CHORUS_CHECK(c.precision == "fp32" || dev.is_cuda(), "--precision bf16 needs a CUDA device (got ", dev.str(), ")");
  models::GPTConfig cfg = models::GPTConfig::named(c.model, 50257, std::max<int64_t>(seq, 1024));
  CHORUS_CHECK(seq <= cfg.context, "--seq-len ", seq, " is above the context");
  cfg.attention = ops::parse_attention_kernel(c.attention);
  CHORUS_CHECK(c.recompute == "never" || c.recompute == "always",
               "--recompute for a GPT is always (every block recomputes its activations) or never, got '", c.recompute, "'");
  cfg.recompute = c.recompute == "always";
  manual_seed(0);
  models::GPT model(cfg);
  model.to(dev);
  optim::AdamWOptions ao{6e-4, 0.9, 0.95, 1e-8, 0.1};
  std::vector<Tensor> params;
  for (auto& [name, p] : model.named_parameters()) {
    params.push_back(p);
    ao.param_weight_decay.push_back(p.dim() >= 2 && name.find(".wte.") == std::string::npos &&
                                            name.find(".wpe.") == std::string::npos
                                        ? 0.1
                                        : 0.0);
  }
  optim::AdamW opt(params, ao);
  const std::optional<DType> cast = c.precision == "bf16" ? std::optional<DType>(kBFloat16) : std::nullopt;
  std::vector<std::pair<Tensor, Tensor>> batch{
      {randint(0, cfg.vocab, {c.batch_size, seq}, {kInt64, dev}), randint(0, cfg.vocab, {c.batch_size, seq}, {kInt64, dev})}};
  // The step as chorus train runs it: one CUDA graph on a GPU unless --no-cuda-graphs.
  parallel::GraphedStepOptions go;
  go.enabled = dev.is_cuda() && !c.no_cuda_graphs;
  go.on_fallback = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
  parallel::GraphedStep graphed(
      [&](const std::vector<Tensor>& in) {
        Tensor l = gpt_forward_backward(model, model, nullptr, {{in[0], in[1]}}, cast);
        optim::clip_grad_norm_(params, 1.0);
        opt.step();
        opt.zero_grad();
        return std::vector<Tensor>{l};
      },
      go);
  Tensor loss;
  auto step = [&] { loss = graphed({batch[0].first, batch[0].second})[0]; };
  for (int64_t i = 0; i < c.warmup; ++i) step();
  synchronize(dev);
  backend(dev).reset_peak_bytes(dev);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < c.steps; ++i) step();
  synchronize(dev);
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double tok_s = static_cast<double>(c.batch_size * seq * c.steps) / dt;
  const double peak_flops = dev.is_cuda() ? bf16_peak_flops(backend(dev).device_name(dev)) : 0.0;
  const double mfu = peak_flops > 0 ? tok_s * cfg.flops_per_token(seq) / peak_flops : 0.0;
  const size_t peak = backend(dev).peak_bytes(dev);
  nlohmann::ordered_json row = {{"model", c.model},
                                {"strategy", c.strategy},
                                {"devices", dev.str()},
                                {"device_name", backend(dev).device_name(dev)},
                                {"precision", c.precision},
                                {"batch_per_device", c.batch_size},
                                {"seq_len", seq},
                                {"attention", c.attention},
                                {"recompute", c.recompute},
                                {"params", cfg.num_parameters()},
                                {"tok_per_s", tok_s},
                                {"step_ms", 1000.0 * dt / static_cast<double>(c.steps)},
                                {"mfu", peak_flops > 0 ? nlohmann::ordered_json(mfu) : nlohmann::ordered_json(nullptr)},
                                {"peak_mem_bytes", peak},
                                {"loss", loss.item()},
                                {"cuda_graph", graphed.replays() >= c.steps}};
  if (c.json) {
    std::printf("%s\n", row.dump().c_str());
  } else {
    std::printf("%-10s %-7s %-7s %-5s batch %lld x %lld  %10.0f tok/s  %8.2f ms/step", c.model.c_str(),
                c.strategy.c_str(), dev.str().c_str(), c.precision.c_str(), (long long)c.batch_size, (long long)seq,
                tok_s, 1000.0 * dt / static_cast<double>(c.steps));
    if (peak_flops > 0) std::printf("  MFU %5.1f%%", 100 * mfu);
    std::printf("  peak %8.1f MiB\n", static_cast<double>(peak) / (1 << 20));
  }
  return 0;
}

}  // namespace chorus::app
