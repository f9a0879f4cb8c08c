#include "chorus/plan/gpt_layout_memory.h"

#include <algorithm>
#include <cmath>

#include "chorus/core/error.h"
#include "chorus/models/gpt_memory.h"

namespace chorus::plan {

bool gpt_fused_attention_on_gpu(const models::GPTConfig& cfg, bool bf16) {
  return cfg.attention == ops::AttentionKernel::Fused ||
         (cfg.attention == ops::AttentionKernel::Auto && bf16 && cfg.head_dim() <= 128 && cfg.dropout == 0);
}

dist::MemoryPlanInputs gpt_memory_inputs(const models::GPTConfig& cfg, const GptMemoryRun& run) {
  dist::MemoryPlanInputs in;
  in.params = cfg.num_parameters();
  in.autocast_copied = models::gpt_autocast_copied_parameters(cfg);
  in.largest_unit_params = models::gpt_block_parameters(cfg);
  in.root_unit_params = models::gpt_root_parameters(cfg);
  in.optimizer_bytes_per_param = 8;  // AdamW
  in.bucket_bytes = run.bucket_bytes;
  in.bf16 = run.bf16;
  in.recompute = cfg.recomputes_every_block();  // some blocks only: planned as none (their casts kept)
  if (run.bf16 && run.zero_param_dtype != "fp32") {
    // add_gpt_sharding's param_dtype: the blocks' matrices, 12 C^2 a block.
    in.low_precision_unit_params = 12 * cfg.width * cfg.width;
    in.low_precision_params = cfg.layers * in.low_precision_unit_params;
  }
  in.activation_bytes = models::gpt_activation_bytes(cfg, run.batch, run.seq, run.bf16, run.fused_attention).total();
  return in;
}

namespace {

int64_t stage_blocks(const models::GPTConfig& cfg, int64_t pp) { return (cfg.layers + pp - 1) / pp; }

// The root's parameters on the heavier end stage (Note [Tensor and pipeline
// memory]), and how many of them autocast copies.
struct EndParams {
  int64_t params = 0, copied = 0;
};

EndParams end_stage_params(const models::GPTConfig& cfg, int64_t tp, int64_t pp) {
  const int64_t wte = cfg.padded_vocab * cfg.width / tp, wpe = cfg.context * cfg.width, ln_f = 2 * cfg.width;
  if (pp == 1) return {wte + wpe + ln_f, wte};
  return wpe >= ln_f ? EndParams{wte + wpe, wte} : EndParams{wte + ln_f, wte};
}

}  // namespace

int64_t mesh_parameters_per_gpu(const models::GPTConfig& cfg, int64_t tp, int64_t pp) {
  return stage_blocks(cfg, pp) * models::gpt_block_parameters(cfg) / tp + end_stage_params(cfg, tp, pp).params;
}

dist::MemoryPlan mesh_memory_plan(const models::GPTConfig& cfg, const GptMemoryRun& run, int64_t dp, int64_t tp,
                                  int64_t pp, int64_t micro_batches, int64_t virtual_stages) {
  CHORUS_CHECK(tp >= 1 && pp >= 1 && dp >= 1, "a mesh needs dp, tp and pp of at least 1, got dp=", dp, ", tp=", tp,
               ", pp=", pp);
  CHORUS_CHECK(pp <= cfg.layers, "pp=", pp, " exceeds the model's ", cfg.layers, " layers");
  CHORUS_CHECK(micro_batches >= 1 && virtual_stages >= 1, "micro-batches and virtual stages must be at least 1");
  const int64_t blocks = stage_blocks(cfg, pp);
  const EndParams end = end_stage_params(cfg, tp, pp);
  const int64_t block_norms = 2 * 2 * cfg.width;
  dist::MemoryPlanInputs in = gpt_memory_inputs(cfg, run);
  in.params = mesh_parameters_per_gpu(cfg, tp, pp);
  in.autocast_copied = blocks * (models::gpt_block_parameters(cfg) - block_norms) / tp + end.copied;
  in.largest_unit_params = models::gpt_block_parameters(cfg) / tp;
  in.root_unit_params = end.params;

  models::GPTConfig stage = cfg;
  stage.layers = blocks;
  const models::GPTActivationBytes a =
      models::gpt_activation_bytes(stage, run.batch, run.seq, run.bf16, run.fused_attention,
                                   /*logits_overwritten=*/false);
  double in_flight = pp == 1 ? 1.0 : static_cast<double>(std::min(micro_batches, pp));
  if (pp > 1 && virtual_stages > 1)
    in_flight *= 1.0 + static_cast<double>(pp - 1) / static_cast<double>(pp * virtual_stages);
  in.activation_bytes = a.embeddings + static_cast<int64_t>(std::llround(static_cast<double>(a.blocks) * in_flight /
                                                                         static_cast<double>(tp))) +
                        a.peak / tp;
  dist::MemoryStrategy s;
  s.name = "ddp";
  s.world = dp;
  return dist::plan_for(s, in);
}

}  // namespace chorus::plan
