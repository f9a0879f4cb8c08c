// The memory plan in the training and benchmark commands (memory_check.h).
#include "memory_check.h"

#include <cmath>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/models/gpt.h"
#include "chorus/models/gpt_memory.h"
#include "chorus/nn/module.h"
#include "chorus/plan/gpt_layout_memory.h"

namespace chorus::app {

dist::MemoryStrategy plan_strategy(const std::string& strategy, int64_t replicas, int64_t world, int zero_stage) {
  dist::MemoryStrategy s;
  s.name = strategy == "dp" || strategy == "ddp" || strategy == "zero" ? strategy : "single";
  s.world = strategy == "ddp" || strategy == "zero" ? world : strategy == "dp" ? replicas : 1;
  s.zero_stage = strategy == "zero" ? zero_stage : 0;
  return s;
}

std::optional<dist::MemoryPlan> check_gpt_memory_plan(const models::GPTConfig& cfg, const GptRun& run,
                                                      const Device& device, const MemoryPlanFlags& flags) {
  const dist::MemoryPlanInputs in = gpt_plan_inputs(cfg, run, device);
  dist::MemoryPlan plan = dist::plan_for(plan_strategy(run.strategy, run.replicas, run.world, run.zero_stage), in);
  if (!check_memory_plan(run.model, plan, in, device, flags)) return std::nullopt;
  return plan;
}

dist::MemoryPlanInputs gpt_plan_inputs(const models::GPTConfig& cfg, const GptRun& run, const Device& device) {
  plan::GptMemoryRun m;
  m.batch = run.batch;
  m.seq = run.seq;
  m.bf16 = run.precision == "bf16";
  // ops::AttentionKernel's rules for the flash path (cuDNN: a GPU, 16-bit,
  // head_dim <= 128, no dropout); Fused where it cannot run fails later anyway.
  m.fused_attention = cfg.attention == ops::AttentionKernel::Fused ||
                      (device.is_cuda() && plan::gpt_fused_attention_on_gpu(cfg, m.bf16));
  m.bucket_bytes = static_cast<int64_t>(run.bucket_mb * (1 << 20));
  m.zero_param_dtype = run.zero_param_dtype;
  dist::MemoryPlanInputs in = plan::gpt_memory_inputs(cfg, m);
  int64_t act = *in.activation_bytes;
  // Note [GPT under DataParallel]: the first device takes every replica's logits for the loss.
  if (run.strategy == "dp" && run.replicas > 1)
    act += (run.replicas - 1) * models::gpt_logits_bytes(cfg, run.batch, run.seq, m.bf16);
  in.activation_bytes = act;
  in.micro_batches = run.micro_batches;
  return in;
}

dist::MemoryPlanInputs module_plan_inputs(const nn::Module& model, bool bf16, int64_t optimizer_bytes_per_param,
                                          double bucket_mb) {
  dist::MemoryPlanInputs in;
  for (const Tensor& p : model.parameters()) {
    in.params += p.numel();
    // Note [Autocast weight copies]: convolution and matrix weights.
    if (p.dim() >= 2) in.autocast_copied += p.numel();
  }
  in.optimizer_bytes_per_param = optimizer_bytes_per_param;
  in.bucket_bytes = static_cast<int64_t>(bucket_mb * (1 << 20));
  in.bf16 = bf16;
  return in;
}

namespace {

// The free memory a plan is held to: --memory-limit-gib, else the device's
// (unknown on a CPU); `where` names it for the messages.
std::optional<int64_t> planned_free_bytes(const Device& device, const MemoryPlanFlags& flags, std::string& where) {
  where = device.str();
  if (flags.limit_gib) {
    CHORUS_CHECK(std::isfinite(*flags.limit_gib) && *flags.limit_gib >= 0, "--memory-limit-gib must be a size in GiB, got ",
                 *flags.limit_gib);
    where += " (--memory-limit-gib)";
    return static_cast<int64_t>(*flags.limit_gib * static_cast<double>(int64_t{1} << 30));
  }
  if (auto info = backend(device).memory_info(device)) return static_cast<int64_t>(info->free);
  return std::nullopt;
}

bool is_count(const std::string& s) {
  return !s.empty() && s.size() <= 6 && s.find_first_not_of("0123456789") == std::string::npos;
}

}  // namespace

void check_gpt_recompute_spelling(const std::string& spec) {
  CHORUS_CHECK(spec == "never" || spec == "always" || spec == "auto" || is_count(spec),
               "--recompute for a GPT is never, always, auto (the fewest blocks the memory plan needs) or a number of "
               "blocks, got '", spec, "'");
}

int64_t gpt_recompute_blocks(const std::string& spec, const models::GPTConfig& cfg, const GptRun& run,
                             const Device& device, const MemoryPlanFlags& flags) {
  check_gpt_recompute_spelling(spec);
  if (spec == "never") return 0;
  if (spec == "always") return cfg.layers;
  if (spec != "auto") {
    const int64_t n = std::stoll(spec);
    CHORUS_CHECK(n <= cfg.layers, "--recompute ", n, ": ", run.model, " has ", cfg.layers,
                 " blocks (--recompute always recomputes every one)");
    return n;
  }
  std::string where;
  const std::optional<int64_t> free_bytes = planned_free_bytes(device, flags, where);
  if (!free_bytes) {
    if (!flags.quiet)
      std::fprintf(stderr, "--recompute auto: %s's free memory is unknown (--memory-limit-gib gives it): no block recomputes\n",
                   device.str().c_str());
    return 0;
  }
  // The plan falls as blocks recompute: the fewest that fit, by bisection.
  const dist::MemoryStrategy strategy = plan_strategy(run.strategy, run.replicas, run.world, run.zero_stage);
  auto fits = [&](int64_t k) {
    models::GPTConfig c = cfg;
    c.recompute_blocks = k;
    return dist::plan_for(strategy, gpt_plan_inputs(c, run, device)).fits(*free_bytes);
  };
  int64_t lo = 0, hi = cfg.layers;
  if (!fits(hi)) {
    lo = hi;  // the plan's refusal follows, with what would fit
  } else {
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (fits(mid)) hi = mid; else lo = mid + 1;
    }
  }
  if (!flags.quiet)
    std::fprintf(stderr, "--recompute auto: %lld of %lld blocks recompute (the fewest with which the memory plan fits %.1f GiB on %s)\n",
                 static_cast<long long>(lo), static_cast<long long>(cfg.layers),
                 static_cast<double>(*free_bytes) / static_cast<double>(int64_t{1} << 30), where.c_str());
  return lo;
}

bool check_memory_plan(const std::string& model, const dist::MemoryPlan& plan, const dist::MemoryPlanInputs& in,
                       const Device& device, const MemoryPlanFlags& flags) {
  std::string where;
  const std::optional<int64_t> free_bytes = planned_free_bytes(device, flags, where);
  const bool shown = !flags.quiet && (device.is_cuda() || flags.show);
  if (shown) std::fprintf(stderr, "%s\n", plan.str(free_bytes).c_str());
  if (!free_bytes || !plan.activations || plan.fits(*free_bytes)) return shown;
  const std::string msg = dist::refusal_message(model, plan, where, *free_bytes, dist::suggest(plan, in, *free_bytes));
  CHORUS_CHECK(flags.ignore, msg);
  if (!flags.quiet) std::fprintf(stderr, "warning: %s\n", msg.c_str());
  return shown;
}

namespace {

std::string format_device_memory(const Device& device, const DeviceBackend::MemoryBreakdown& b) {
  auto gib = [](size_t x) { return static_cast<double>(x) / static_cast<double>(size_t{1} << 30); };
  char buf[320];
  std::snprintf(buf, sizeof buf,
                "device memory on %s: %.2f GiB used of %.2f GiB: tensors %.2f, CUDA graphs' pools %.2f, kept by the "
                "allocator %.2f (front cache %.2f, pool idle %.2f), context and libraries %.2f GiB",
                device.str().c_str(), gib(b.used), gib(b.total), gib(b.tensors), gib(b.graph_pools),
                gib(b.allocator_kept), gib(b.cached), gib(b.pool_idle), gib(b.other));
  return buf;
}

}  // namespace

std::optional<std::string> device_memory_line(const Device& device) {
  const auto b = backend(device).memory_breakdown(device);
  if (!b) return std::nullopt;
  return format_device_memory(device, *b);
}

std::optional<std::string> add_device_memory(nlohmann::ordered_json& out, const Device& device) {
  const auto b = backend(device).memory_breakdown(device);
  if (!b) return std::nullopt;
  out["device_memory"] = {{"used", b->used},         {"total", b->total},
                          {"tensors", b->tensors},   {"graph_pools", b->graph_pools},
                          {"allocator_kept", b->allocator_kept}, {"front_cache", b->cached},
                          {"pool_idle", b->pool_idle}, {"other", b->other}};
  return format_device_memory(device, *b);
}

}  // namespace chorus::app
