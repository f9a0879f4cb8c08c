// The memory a GPT needs per GPU under a layout, from its configuration alone:
// the inputs of Note [Memory plan formulas] (data_parallel/memory_plan.h) for data
// parallelism and ZeRO -- the ones `chorus train` plans with -- and, in one
// place, what tensor and pipeline parallelism change in them.
//
// Note [Tensor and pipeline memory]: a GPU of a mesh dp x tp x pp holds
//   - its stage's blocks, ceil(L / pp) of them, each 1/tp of a block (the
//     column- and row-parallel matrices and their biases are split; the
//     norms and the row-parallel biases are small and counted split too);
//   - the root's parameters where its stage uses them: the token embedding
//     (1/tp of its rows, vocabulary-parallel) on the first and the last
//     stage, the position embedding on the first, the final norm on the
//     last; the heavier of the two ends is counted;
//   - float32 gradients and AdamW's moments of those, replicated over dp
//     (DDP over the data axis: the mesh composes with DDP, not ZeRO);
//   - one micro-batch's activations (Note [GPT activation count]) for the
//     stage's blocks, divided by tp (sequence parallelism: the norms' and the
//     residual stream's too), times the micro-batches in flight on the
//     first stage: min(m, pp) under 1F1B, times (1 + (pp-1)/(pp v)) under
//     the interleaved schedule with v chunks (Megatron-LM's count); the
//     classifier's logits are 1/tp of the vocabulary.
// tp = pp = 1 is DDP's plan exactly.
#pragma once

#include <cstdint>
#include <string>

#include "chorus/data_parallel/memory_plan.h"
#include "chorus/models/gpt.h"

namespace chorus::plan {

// One micro-batch of `batch` sequences of `seq` tokens per device, the
// precision, and ZeRO's gathered dtype (--zero-param-dtype: "" means bf16
// under bf16, as `chorus train`).
struct GptMemoryRun {
  int64_t batch = 1, seq = 1;
  bool bf16 = false;
  bool fused_attention = false;  // the flash kernel runs (CUDA, 16-bit, head_dim <= 128, no dropout)
  int64_t bucket_bytes = 25 << 20;
  std::string zero_param_dtype;
};

// Note [Memory plan formulas]' inputs for a GPT (the activations of one
// micro-batch on one device; DataParallel's gathered logits are the caller's).
dist::MemoryPlanInputs gpt_memory_inputs(const models::GPTConfig& cfg, const GptMemoryRun& run);

// Whether the flash kernel runs for this configuration on a GPU at this
// precision (ops::AttentionKernel's rules).
bool gpt_fused_attention_on_gpu(const models::GPTConfig& cfg, bool bf16);

// Note [Tensor and pipeline memory]: the plan of one GPU of a dp x tp x pp
// mesh, with m micro-batches of `run.batch` sequences and v chunks a device.
// ValueError when tp or pp is below 1, pp exceeds the layers, m < 1 or v < 1.
dist::MemoryPlan mesh_memory_plan(const models::GPTConfig& cfg, const GptMemoryRun& run, int64_t dp, int64_t tp,
                                  int64_t pp, int64_t micro_batches, int64_t virtual_stages);

// The parameters one GPU of a tp x pp mesh holds (the heavier end stage).
int64_t mesh_parameters_per_gpu(const models::GPTConfig& cfg, int64_t tp, int64_t pp);

}  // namespace chorus::plan
