// The memory plan: bytes per GPU for the weights, gradients, optimizer state,
// communication buffers and one micro-batch's activations under a training
// strategy, before anything is allocated -- so a run that cannot fit stops at
// once with a message that says what would (ShardedDataParallel's "a memory
// plan printed before step 1, and a refusal before anything runs out").
// Pure arithmetic and formatting: the callers bring the model's counts
// (models/gpt_memory.h for GPTs) and the device's free memory.
//
// Note [Memory plan formulas]: P parameters (float32 masters), Pc of them with
// a 16-bit autocast copy under bf16 (Note [Autocast weight copies]), N ranks
// sharing the states, O optimizer bytes per parameter (AdamW: exp_avg and
// exp_avg_sq, 8), U the
// largest unit's parameters (a transformer block), R the root unit's (the
// embeddings and final norm), K the bucket bytes:
//
//   strategy   weights              gradients                   optimizer  comm
//   single     4P + 2Pc             [4P]                        O P        0
//   dp, ddp    4P + 2Pc             4P (the buckets)            O P        K
//   zero 1     4P + 2Pc             4P                          O P/N      K
//   zero 2     4P + 2Pc             2K + [4P/N]                 O P/N      K
//   zero 3     4P/N + 4(2U + R)     4(2U + R) + [4P/N]          O P/N      K
//              + 2Pc
//
// [x] = max(0, x - A), A the activations (x itself when A is not known, or
// with several micro-batches a step, whose gradients outlive a forward): no
// gradient of its own persists across steps. One device's gradients are made
// in the backward as the activations go and dropped by zero_grad() after the
// step (the trainers' rule), and so are the shards of stages 2-3 (Note
// [Sharded gradient shards] in sharded.h): they raise the peak only where
// they outgrow the activations they follow. DDP's gradients are its buckets,
// and stage 1 reduce-scatters in place, so its shards are segments of its
// full buffers: both hold 4P for good. Inside a CUDA graph the same holds:
// the graph's pool gives the backward's gradients the forward's freed
// activations (Note [Graph pools] in cuda/runtime/allocator.h).
//
// dp: the fullest device is the first, which steps the weights (Note [GPT
// under DataParallel]); the caller adds what it gathers there to the
// activations. zero 2's full gradients live only in the buckets in flight
// (about two); zero 3 gathers at most two units at a time in float32 (and
// their gradients before the reduce-scatter) plus the root unit for the whole
// step, and under bf16 the graph keeps each matrix's per-use cast until that
// unit's backward (2Pc: the engine keeps no cast between steps, but does not
// yet gather in bfloat16; with recompute only the casts of the two units in
// flight and the root's, 2(2U + R)). The comm column is one bucket of scratch (a compressed copy, a
// reduce-scatter's staging). plan_for() is the one place these live: adjust
// them there when the engine's buffers change.
//
// With param_dtype (Pm of the parameters in 16 bits while gathered, Um of
// the largest unit's; Pf = P - Pm, Uf = U - Um): the full weights of stages
// 1-2 are 4Pf + 2Pm and their float32 masters 4Pm/N more; stage 1's
// gradient buffer 4Pf + 2Pm, the float32 shards of its 16-bit part cast
// after the backward into the buffer itself from N = 4 on (0 more), beside
// it below ([4Pm/N]); stage 3 gathers 4Uf + 2Um a unit (and its
// gradients); the 16-bit copies are only the other copied parameters'
// (2(Pc - Pm): a GPT's tied embedding).
//
// Note [Memory plan reserve]: the components add up to what the allocator
// hands out (comparable with DeviceBackend::peak_bytes). The device must also
// hold what nobody asks for by name: the caching allocator's rounding to its
// size classes (up to 12.5% of a request, most of it on small blocks), blocks
// cached on one stream while another allocates, cuBLAS/cuDNN workspaces and
// NCCL's own buffers. needed() adds 5% of the total plus 512 MiB for these;
// fits() compares needed() with the free memory.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace chorus::dist {

// How the training states are laid out over the GPUs.
struct MemoryStrategy {
  std::string name = "single";  // single | dp | ddp | zero
  int zero_stage = 0;           // 1, 2 or 3 with zero
  int64_t world = 1;            // ranks sharing zero's states (N); replicas elsewhere
  // The command-line spelling: "--strategy ddp", "--strategy zero --zero-stage 3".
  std::string flags() const;
};

// What the plan needs to know of the model and the run.
struct MemoryPlanInputs {
  int64_t params = 0;               // P: every parameter, float32
  int64_t autocast_copied = 0;      // Pc: parameters with a 16-bit copy (counted only when bf16)
  int64_t largest_unit_params = 0;  // U: zero 3's largest unit (a transformer block)
  int64_t root_unit_params = 0;     // R: zero 3's root unit (embeddings, final norm)
  int64_t optimizer_bytes_per_param = 8;  // O: AdamW 8, SGD with momentum 4, without 0
  int64_t bucket_bytes = 25 << 20;        // K
  bool bf16 = false;
  // Every block recomputes its activations in the backward (--recompute
  // always): under zero 3 a block's per-use 16-bit casts then live only while
  // it is recomputed, two blocks at a time, not for the whole step.
  bool recompute = false;
  // zero under ShardOptions::param_dtype: Pm parameters (Um of the largest
  // unit) held in 16 bits while gathered, over float32 masters (a GPT's
  // block matrices); the other strategies ignore them.
  int64_t low_precision_params = 0;
  int64_t low_precision_unit_params = 0;
  // One micro-batch's activations on the fullest device; unset: not known
  // before the first step (measured then, e.g. for a CNN).
  std::optional<int64_t> activation_bytes;
  // Micro-batches a step (--grad-accum): above 1 the first one's gradients
  // live through the next one's forward.
  int64_t micro_batches = 1;
};

struct MemoryPlan {
  MemoryStrategy strategy;
  int64_t weights = 0, gradients = 0, optimizer = 0, communication = 0;
  std::optional<int64_t> activations;  // unset: measured on the first step
  // The components' sum (the activations when known): comparable with a
  // measured peak.
  int64_t total() const;
  // total() plus Note [Memory plan reserve]: what the device must have free.
  int64_t needed() const;
  bool fits(int64_t free_bytes) const { return needed() <= free_bytes; }
  // A short table in GiB, one component a line, then the total and what the
  // device needs; `free_bytes` (when known) adds the device's free memory.
  std::string str(std::optional<int64_t> free_bytes = std::nullopt) const;
  // "weights 5.8, gradients 5.8, optimizer 11.6, activations 27.9" (GiB).
  std::string breakdown() const;
};

// Note [Memory plan formulas]. Throws ValueError for a strategy it does not
// know, a zero stage outside 1..3 or a world below 1.
MemoryPlan plan_for(const MemoryStrategy& strategy, const MemoryPlanInputs& in);

// ddp, zero 1, zero 2, zero 3 over `world` ranks: cheapest (least
// communication) first.
std::vector<MemoryStrategy> data_parallel_layouts(int64_t world);
// When `current` does not fit in free_bytes: the cheapest layout that would,
// tried in the order of `candidates` (default: data_parallel_layouts) over
// current's number of ranks; the first whose needed() fits and is below
// current's. nullopt when `current` fits or none does.
std::optional<MemoryPlan> suggest(const MemoryPlan& current, const MemoryPlanInputs& in, int64_t free_bytes,
                                  std::optional<std::vector<MemoryStrategy>> candidates = std::nullopt);

// The refusal: "gpt2-xl with --strategy ddp needs 52.1 GiB per GPU (weights
// 5.8, ...), cuda:0 has 79.1 GiB free; with --strategy zero --zero-stage 3 it
// would need 9.0 GiB" (or "; no data-parallel layout over N GPUs fits:
// fewer tokens per micro-batch (--batch-size) or --recompute lower the
// activations").
std::string refusal_message(const std::string& model, const MemoryPlan& plan, const std::string& device,
                            int64_t free_bytes, const std::optional<MemoryPlan>& suggestion);

// "memory: peak 12.3 GiB measured, plan 12.9 GiB (95%)" after the first step;
// with the activations unknown, the measured peak less the plan's static part
// names them: "memory: peak 3.1 GiB measured, 0.4 GiB before the activations;
// activations and workspaces 2.7 GiB (measured on the first step)".
std::string measured_line(const MemoryPlan& plan, int64_t peak_bytes);

// Bytes as GiB: one decimal from 10 GiB on ("52.1"), two below ("5.84").
std::string gib(int64_t bytes);

}  // namespace chorus::dist
