// The memory plan (data_parallel/memory_plan.h) as `chorus train` and `chorus bench`
// use it: a GPT's plan computed from its configuration before the model is
// built, printed and compared with the device's free memory, with a refusal
// before anything is allocated when it will not fit; any other model's static
// part (weights, gradients, optimizer) with its activations measured on the
// first step. Options: --memory-plan (print on CPUs too), --ignore-memory-plan,
// --memory-limit-gib (plan against that much free memory: for a machine you
// do not have, and for tests).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "chorus/core/device.h"
#include "chorus/data_parallel/memory_plan.h"

namespace CLI {
class App;
}
namespace chorus::models {
struct GPTConfig;
}
namespace chorus::nn {
class Module;
}

namespace chorus::app {

struct MemoryPlanFlags {
  bool show = false;                     // --memory-plan: print on CPUs too (GPUs: always, unless quiet)
  bool ignore = false;                   // --ignore-memory-plan: run even when it will not fit
  std::optional<double> limit_gib;       // --memory-limit-gib: the free memory to plan against
  bool quiet = false;                    // --quiet (or not rank 0): nothing printed, the refusal still stands
};

// --memory-plan, --ignore-memory-plan and --memory-limit-gib on `cmd`
// (train_gpt_options.cpp).
void add_memory_plan_options(CLI::App* cmd, MemoryPlanFlags& flags);

// A GPT run: one micro-batch of `batch` sequences of `seq` tokens per device;
// `replicas` devices of one process under dp (the first gathers their logits),
// `world` processes under ddp or zero (the ranks sharing zero's states, with
// its stage); AdamW.
struct GptRun {
  std::string model, strategy = "single", precision = "fp32";  // strategy: single | dp | ddp | zero
  int64_t batch = 1, seq = 1, replicas = 1, world = 1;
  double bucket_mb = 25;
  int zero_stage = 0;  // 1, 2 or 3 with strategy zero
  std::string zero_param_dtype;  // --zero-param-dtype ("": bf16 under bf16, as add_gpt_sharding)
  int64_t micro_batches = 1;     // --grad-accum
};

// The whole check for a GPT, from its configuration, before the model is
// built: the plan's inputs, the plan, check_memory_plan. Returns the plan when
// it was printed (the caller then prints measured_line), else nullopt.
// `chorus train --strategy zero --zero-stage S` (ShardedDataParallel's
// driver) calls it with strategy "zero", zero_stage S and world = the ranks,
// before any rendezvous, as the ddp driver does.
std::optional<dist::MemoryPlan> check_gpt_memory_plan(const models::GPTConfig& cfg, const GptRun& run,
                                                      const Device& device, const MemoryPlanFlags& flags);

// --recompute for a GPT: never (0 blocks), always (every block), a number N
// (the first N blocks: Note [Recomputing some blocks] in models/gpt.cpp), or
// auto: the fewest blocks with which the memory plan fits the free memory
// (the device's, or --memory-limit-gib); every block when none fits, so that
// the plan's refusal then says what would; none where the free memory is not
// known (a CPU without --memory-limit-gib). `run` and `flags` as for
// check_gpt_memory_plan; auto prints its choice unless flags.quiet. Throws
// ValueError naming the flag for anything else, or N above the blocks.
int64_t gpt_recompute_blocks(const std::string& spec, const models::GPTConfig& cfg, const GptRun& run,
                             const Device& device, const MemoryPlanFlags& flags);
// The spellings gpt_recompute_blocks takes, checked before any model or
// device exists (N's upper bound is checked there).
void check_gpt_recompute_spelling(const std::string& spec);

// Note [Memory plan formulas]' inputs for a GPT, from its configuration.
// fused_attention: whether the flash kernel will run on `device`.
dist::MemoryPlanInputs gpt_plan_inputs(const models::GPTConfig& cfg, const GptRun& run, const Device& device);
// The layout of a command-line strategy (single, dp, ddp, zero).
dist::MemoryStrategy plan_strategy(const std::string& strategy, int64_t replicas, int64_t world, int zero_stage = 0);

// Note [Measured beside the plan]: the trainers print measured_line with the
// peak of the first two steps, not of the first alone: the optimizer makes
// its state at its first update, after that step's activations are gone, so
// only from the second step on do they live together as the plan adds them.
// (`chorus bench` measures its timed steps, after the warm-up.)
//
// Prints the plan (on a GPU or with --memory-plan, unless quiet) and, when the
// free memory is known (the device's, or --memory-limit-gib) and the plan does
// not fit, throws ValueError with dist::refusal_message (unless --ignore-memory-plan,
// which prints it as a warning). Returns whether the plan was printed (then
// the caller prints measured_line: Note [Measured beside the plan]).
bool check_memory_plan(const std::string& model, const dist::MemoryPlan& plan, const dist::MemoryPlanInputs& in,
                       const Device& device, const MemoryPlanFlags& flags);

// A model already built (CNNs: the activations are measured on the first
// step): its parameters' plan with `optimizer_bytes_per_param`.
dist::MemoryPlanInputs module_plan_inputs(const nn::Module& model, bool bf16, int64_t optimizer_bytes_per_param,
                                          double bucket_mb);

}  // namespace chorus::app

namespace chorus::app {

// Note [Device memory breakdown] (core/backend.h) of `device` now, as one
// line ("device memory on cuda:0: 41.50 GiB used of 139.80 GiB: tensors
// 20.31, CUDA graphs' pools 20.25, ..."); nullopt where the device keeps no
// count (the CPU). add_device_memory also puts the parts (bytes) in
// out["device_memory"], from the same reading.
std::optional<std::string> device_memory_line(const Device& device);
std::optional<std::string> add_device_memory(nlohmann::ordered_json& out, const Device& device);

}  // namespace chorus::app
