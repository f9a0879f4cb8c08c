#include "chorus/data_parallel/memory_plan.h"

#include <algorithm>
#include <cstdio>

#include "chorus/core/error.h"

namespace chorus::dist {

namespace {

constexpr int64_t kGiB = int64_t{1} << 30;
// Note [Memory plan reserve].
constexpr double kReserveFraction = 0.05;
constexpr int64_t kReserveBytes = int64_t{512} << 20;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

std::string gib(int64_t bytes) {
  // Two decimals below 10 GiB: a small model's plan should not read 0.0.
  char buf[32];
  const double g = static_cast<double>(bytes) / static_cast<double>(kGiB);
  std::snprintf(buf, sizeof buf, g < 9.995 ? "%.2f" : "%.1f", g);
  return buf;
}

std::string MemoryStrategy::flags() const {
  if (name == "zero") return "--strategy zero --zero-stage " + std::to_string(zero_stage);
  return "--strategy " + name;
}

int64_t MemoryPlan::total() const { return weights + gradients + optimizer + communication + activations.value_or(0); }

int64_t MemoryPlan::needed() const {
  const int64_t t = total();
  return t + static_cast<int64_t>(kReserveFraction * static_cast<double>(t)) + kReserveBytes;
}

MemoryPlan plan_for(const MemoryStrategy& s, const MemoryPlanInputs& in) {
  CHORUS_CHECK(s.world >= 1, "memory plan: the world size must be at least 1, got ", s.world);
  CHORUS_CHECK(in.params >= 0 && in.autocast_copied >= 0 && in.autocast_copied <= in.params,
               "memory plan: parameter counts ", in.params, " (", in.autocast_copied, " copied) are not valid");
  // Note [Memory plan formulas], row by row.
  const int64_t p = in.params, n = s.world, o = in.optimizer_bytes_per_param, k = in.bucket_bytes;
  const int64_t copies = in.bf16 ? 2 * in.autocast_copied : 0;
  const int64_t shard = ceil_div(p, n);
  MemoryPlan m;
  m.strategy = s;
  m.activations = in.activation_bytes;
  // Gradients made in the backward and freed by the step's zero_grad() add
  // to the peak only past the activations, which are gone by then (the [x]
  // of the note).
  const auto past_activations = [&in](int64_t bytes) {
    if (in.micro_batches > 1) return bytes;
    return std::max<int64_t>(0, bytes - in.activation_bytes.value_or(0));
  };
  if (s.name == "single" || s.name == "dp" || s.name == "ddp") {
    m.weights = 4 * p + copies;
    m.gradients = s.name == "single" ? past_activations(4 * p) : 4 * p;
    m.optimizer = o * p;
    m.communication = s.name == "single" ? 0 : k;
    return m;
  }
  CHORUS_CHECK(s.name == "zero", "memory plan: unknown strategy '", s.name, "' (single, dp, ddp or zero)");
  CHORUS_CHECK(s.zero_stage >= 1 && s.zero_stage <= 3, "memory plan: --zero-stage must be 1, 2 or 3, got ",
               s.zero_stage);
  m.optimizer = o * shard;
  m.communication = k;
  const int64_t pm = in.bf16 ? in.low_precision_params : 0;
  if (pm > 0) {
    // ShardOptions::param_dtype (see the note's last paragraph).
    CHORUS_CHECK(pm <= in.autocast_copied && in.low_precision_unit_params <= in.largest_unit_params,
                 "memory plan: ", pm, " 16-bit parameters of ", in.autocast_copied, " copied are not valid");
    const int64_t um = in.low_precision_unit_params, u = in.largest_unit_params, r = in.root_unit_params;
    const int64_t full = 4 * (p - pm) + 2 * pm, other_copies = 2 * (in.autocast_copied - pm);
    if (s.zero_stage == 1) {
      // Reduced in place; the 16-bit buffers' float32 shards are cast into
      // the buffers themselves from 4 ranks on, made apart below that.
      m.weights = full + 4 * ceil_div(pm, n) + other_copies;
      m.gradients = full + (n >= 4 ? 0 : past_activations(4 * ceil_div(pm, n)));
    } else if (s.zero_stage == 2) {
      m.weights = full + 4 * ceil_div(pm, n) + other_copies;
      m.gradients = 2 * k + past_activations(4 * shard);
    } else {
      const int64_t gathered = 2 * (4 * (u - um) + 2 * um) + 4 * r;
      m.weights = 4 * shard + gathered + other_copies;
      m.gradients = gathered + past_activations(4 * shard);
    }
    return m;
  }
  if (s.zero_stage == 1) {
    // Reduced in place: the shards are the buffers' own segments.
    m.weights = 4 * p + copies;
    m.gradients = 4 * p;
  } else if (s.zero_stage == 2) {
    m.weights = 4 * p + copies;
    m.gradients = 2 * k + past_activations(4 * shard);
  } else {
    // The engine gathers in the weights' own dtype (float32) and autocast
    // casts each matrix at each use, the graph keeping the cast for the
    // backward: under bf16, 2 bytes per copied parameter for the step
    // (data_parallel/sharded.h, Note [Sharded gathers]).
    const int64_t gathered = 4 * (2 * in.largest_unit_params + in.root_unit_params);
    // --recompute: a unit's casts live from its recomputation to the end of
    // its backward (Note [Memory plan formulas]).
    const int64_t kept_copies =
        in.bf16 && in.recompute ? std::min(copies, 2 * (2 * in.largest_unit_params + in.root_unit_params)) : copies;
    m.weights = 4 * shard + gathered + kept_copies;
    m.gradients = gathered + past_activations(4 * shard);
  }
  return m;
}

std::vector<MemoryStrategy> data_parallel_layouts(int64_t world) {
  return {{"ddp", 0, world}, {"zero", 1, world}, {"zero", 2, world}, {"zero", 3, world}};
}

std::optional<MemoryPlan> suggest(const MemoryPlan& current, const MemoryPlanInputs& in, int64_t free_bytes,
                                  std::optional<std::vector<MemoryStrategy>> candidates) {
  if (current.fits(free_bytes)) return std::nullopt;
  for (MemoryStrategy s : candidates ? *candidates : data_parallel_layouts(current.strategy.world)) {
    s.world = current.strategy.world;
    if (s.name == current.strategy.name && s.zero_stage == current.strategy.zero_stage) continue;
    MemoryPlan p = plan_for(s, in);
    if (p.fits(free_bytes) && p.needed() < current.needed()) return p;
  }
  return std::nullopt;
}

std::string MemoryPlan::breakdown() const {
  std::string s = "weights " + gib(weights) + ", gradients " + gib(gradients) + ", optimizer " + gib(optimizer);
  if (communication) s += ", communication " + gib(communication);
  s += activations ? ", activations " + gib(*activations) : ", activations measured on the first step";
  return s;
}

std::string MemoryPlan::str(std::optional<int64_t> free_bytes) const {
  std::string out = "memory plan per GPU (" + strategy.flags() +
                    (strategy.world > 1 ? ", " + std::to_string(strategy.world) + " ranks" : "") + "):\n";
  auto row = [&out](const char* name, const std::string& value) {
    char line[96];
    std::snprintf(line, sizeof line, "  %-15s %8s GiB\n", name, value.c_str());
    out += line;
  };
  row("weights", gib(weights));
  row("gradients", gib(gradients));
  row("optimizer", gib(optimizer));
  row("communication", gib(communication));
  if (activations) {
    row("activations", gib(*activations));
  } else {
    out += "  activations     measured on the first step\n";
  }
  row("total", gib(total()));
  row("with reserve", gib(needed()));
  if (free_bytes) row("free", gib(*free_bytes));
  out.pop_back();
  return out;
}

std::string refusal_message(const std::string& model, const MemoryPlan& plan, const std::string& device,
                            int64_t free_bytes, const std::optional<MemoryPlan>& suggestion) {
  std::string s = model + " with " + plan.strategy.flags() + " needs " + gib(plan.needed()) + " GiB per GPU (" +
                  plan.breakdown() + ", reserve " + gib(plan.needed() - plan.total()) + "), " + device + " has " +
                  gib(free_bytes) + " GiB free";
  if (suggestion) {
    s += "; with " + suggestion->strategy.flags() + " it would need " + gib(suggestion->needed()) + " GiB";
  } else {
    s += "; no data-parallel layout over " + std::to_string(plan.strategy.world) +
         " GPU(s) fits: a smaller --batch-size or --seq-len, --recompute always or more GPUs would lower it";
  }
  return s + " (--ignore-memory-plan runs anyway)";
}

std::string measured_line(const MemoryPlan& plan, int64_t peak_bytes) {
  if (plan.activations) {
    const double pct = plan.total() > 0 ? 100.0 * static_cast<double>(peak_bytes) / static_cast<double>(plan.total()) : 0.0;
    char pc[32];
    std::snprintf(pc, sizeof pc, "%.0f%%", pct);
    return "memory: peak " + gib(peak_bytes) + " GiB measured, plan " + gib(plan.total()) + " GiB (" + pc + ")";
  }
  const int64_t fixed = plan.total();
  const int64_t act = peak_bytes > fixed ? peak_bytes - fixed : 0;
  return "memory: peak " + gib(peak_bytes) + " GiB measured, " + gib(fixed) + " GiB before the activations; " +
         "activations and workspaces " + gib(act) + " GiB (measured on the first step)";
}

}  // namespace chorus::dist
