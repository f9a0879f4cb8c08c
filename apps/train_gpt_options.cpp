// The GPT options of `chorus train` (train_gpt.h), beside cli.cpp's shared
// ones: their definitions and their checks (validate_gpt).
#include <cmath>

#include "chorus/core/error.h"
#include "chorus/parallel/pipeline.h"
#include "cli_numbers.h"
#include "cli_options.h"
#include "memory_check.h"
#include "step_trace.h"
#include "train_dist.h"
#include "train_gpt.h"
#include "train_pipeline.h"
#include "train_zero.h"

namespace chorus::app {

void add_gpt_train_options(CLI::App* train, GptOptions& g) {
  const std::string grp = "GPT models (gpt2 ... gpt2-xl, d6 ... d84)";
  train->add_option("--seq-len", g.seq_len, "GPT: tokens per sequence (default 1024; 256 for --data text:FILE)")
      ->transform(integer_up_to(1 << 20))->group(grp);
  add_optional(train, "--val-data", g.val_data, "GPT: validation tokens:GLOB or text:FILE (default for text:FILE: its last 10%)")
      ->group(grp);
  train->add_option("--val-every", g.val_every, "GPT: validate every N steps (0: at the end only)")
      ->transform(integer_up_to(kMaxSteps))->group(grp);
  train->add_option("--val-windows", g.val_windows, "GPT: evenly spaced validation windows")
      ->capture_default_str()->transform(integer_up_to(1 << 20))->group(grp);
  train->add_option("--grad-accum", g.grad_accum, "GPT: micro-batches per optimizer step")
      ->capture_default_str()->transform(integer_up_to(1 << 20))->group(grp);
  train->add_option("--clip", g.clip, "GPT: clip gradients to this global norm (0: off)")
      ->capture_default_str()->check(real_number(1e12))->group(grp);
  add_optional(train, "--warmup-steps", g.warmup_steps, "GPT: linear warm-up steps (default 5% of the steps)")
      ->transform(integer_up_to(kMaxSteps))->group(grp);
  train->add_option("--min-lr-ratio", g.min_lr_ratio, "GPT: the cosine schedule ends at lr times this")
      ->capture_default_str()->check(real_number(1))->group(grp);
  train->add_option("--windows", g.windows, "GPT: sequential (epochs of disjoint windows) | random (any start)")
      ->capture_default_str()->group(grp);
  train->add_flag("--decay-embeddings", g.decay_embeddings, "GPT: weight decay on the embeddings too")->group(grp);
  add_optional(train, "--init-from", g.init_from, "GPT: start from a Hugging Face GPT-2 model.safetensors")->group(grp);
  add_optional(train, "--save-hf", g.save_hf, "GPT: write the trained weights as a Hugging Face model.safetensors")
      ->group(grp);
  train->add_flag("--skip-nan", g.skip_nan, "GPT: skip a step whose loss is NaN instead of stopping")->group(grp);
  train->add_option("--dropout", g.dropout, "GPT: dropout on embeddings and residual branches")
      ->capture_default_str()->check(real_number(1, true, 0))->group(grp);
  train->add_flag("--recompute-gelu", g.recompute_gelu,
                  "GPT: the MLP keeps GELU's input only and the backward computes GELU again (a quarter less "
                  "activation memory a block; llm.c's -r 1)")
      ->group(grp);
  train->add_option("--attention", g.attention,
                    "GPT: auto (the fused flash kernel where the GPU has one) | fused | composite")
      ->capture_default_str()->group(grp);
  add_optional(train, "--mesh", g.mesh,
               "GPT: process layout dp=A,pp=B,tp=C (A x B x C processes from chorus launch; tensor parallel over tp, "
               "pipeline stages over pp with --micro-batches, --schedule 1f1b|gpipe|interleaved, --virtual-stages, --balance)")
      ->group(grp);
  train->add_flag("--sequence-parallel", g.sequence_parallel,
                  "GPT with --mesh tp>1: shard LayerNorm and dropout activations along the sequence")
      ->group(grp);
  train->add_option("--tp-chunks", g.tp_chunks,
                    "GPT with --mesh tp>1 --sequence-parallel: split each rank's tokens into K chunks so that the "
                    "all-gathers and reduce-scatters run beside the matrix products (1: one collective per op; a K that "
                    "does not divide the tokens per rank runs as 1)")
      ->capture_default_str()->group(grp);
  train->add_flag("--allow-tp-across-nodes", g.allow_tp_across_nodes,
                  "GPT with --mesh: let a tensor-parallel group span nodes")
      ->group(grp);
}

void add_memory_plan_options(CLI::App* cmd, MemoryPlanFlags& flags) {
  const std::string grp = "Memory plan";
  cmd->add_flag("--memory-plan", flags.show,
                "Print the memory plan (bytes per GPU for weights, gradients, optimizer, communication, activations) "
                "on CPUs too; GPUs print it unless --quiet")->group(grp);
  cmd->add_flag("--ignore-memory-plan", flags.ignore, "Run even when the memory plan says it will not fit")->group(grp);
  add_optional(cmd, "--memory-limit-gib", flags.limit_gib,
               "Plan against this much free memory per device instead of the device's own (planning for a machine "
               "you do not have)")->check(real_number(1e9, false, 0))->group(grp);
}

void validate_gpt(const TrainConfig& tc, const GptOptions& g) {
  CHORUS_CHECK(is_gpt_model(tc.model), "unknown GPT model '", tc.model, "'");
  CHORUS_CHECK(tc.data.rfind("tokens:", 0) == 0 || text_spec(tc.data), "--data for a GPT must be tokens:GLOB (llm.c ",
               "token files) or text:FILE (a text file's bytes), got '", tc.data, "'");
  CHORUS_CHECK(tc.strategy == "single" || tc.strategy == "ddp" || tc.strategy == "dp" || tc.strategy == "pipeline" ||
                   tc.strategy == "zero",
               "--strategy ", tc.strategy, " is not available for GPT models (single, dp, ddp, zero or pipeline)");
  validate_zero_options(tc);
  CHORUS_CHECK(tc.strategy != "zero" || !g.skip_nan, "--skip-nan is not offered with --strategy zero yet");
  if (tc.strategy == "pipeline") {
    CHORUS_CHECK(!tc.micro_batches || *tc.micro_batches >= 1, "--micro-batches must be at least 1");
    if (tc.schedule) (void)parallel::parse_schedule(*tc.schedule);
    if (tc.balance) {
      CHORUS_CHECK(*tc.balance != "time" && *tc.balance != "memory", "--balance for a GPT is a layer count per stage ",
                   "(the embeddings, each block and the head are layers), e.g. 7,7; the default splits them evenly");
      (void)parse_balance(*tc.balance);
    }
    CHORUS_CHECK(!tc.virtual_stages || tc.schedule.value_or("") == "interleaved",
                 "--virtual-stages goes with --schedule interleaved");
  } else if (!g.mesh) {  // with --mesh: validate_gpt_mesh (they go with pp > 1)
    const char* given = tc.micro_batches ? "--micro-batches" : tc.schedule ? "--schedule" : tc.balance ? "--balance"
                        : tc.virtual_stages ? "--virtual-stages" : nullptr;
    CHORUS_CHECK(given == nullptr, given ? given : "", " goes with --strategy pipeline");
  }
  CHORUS_CHECK(tc.precision == "fp32" || tc.precision == "bf16", "unknown precision '", tc.precision,
               "' (expected fp32 or bf16)");
  CHORUS_CHECK(!g.optimizer_given || tc.optimizer == "adamw", "GPT models train with AdamW (--optimizer ",
               tc.optimizer, " is not offered for them)");
  CHORUS_CHECK(g.seq_len >= 0, "--seq-len must be positive, got ", g.seq_len);
  CHORUS_CHECK(g.grad_accum >= 1, "--grad-accum must be at least 1, got ", g.grad_accum);
  CHORUS_CHECK(g.val_every >= 0, "--val-every must be >= 0, got ", g.val_every);
  CHORUS_CHECK(g.val_windows >= 1, "--val-windows must be at least 1, got ", g.val_windows);
  CHORUS_CHECK(std::isfinite(g.clip) && g.clip >= 0, "--clip must be a number >= 0, got ", g.clip);
  CHORUS_CHECK(std::isfinite(g.min_lr_ratio) && g.min_lr_ratio >= 0 && g.min_lr_ratio <= 1,
               "--min-lr-ratio must be in [0, 1], got ", g.min_lr_ratio);
  CHORUS_CHECK(!g.warmup_steps || *g.warmup_steps >= 0, "--warmup-steps must be >= 0, got ", g.warmup_steps.value_or(0));
  CHORUS_CHECK(g.windows == "sequential" || g.windows == "random", "--windows must be sequential or random, got '",
               g.windows, "'");
  CHORUS_CHECK(g.dropout >= 0 && g.dropout < 1, "--dropout must be in [0, 1), got ", g.dropout);
  CHORUS_CHECK(g.attention == "auto" || g.attention == "fused" || g.attention == "composite",
               "--attention must be auto, fused or composite, got '", g.attention, "'");
  if (tc.recompute) check_gpt_recompute_spelling(*tc.recompute);
  CHORUS_CHECK(tc.strategy != "pipeline" || !tc.recompute || *tc.recompute == "never" || *tc.recompute == "always",
               "--recompute ", tc.recompute.value_or(""), " counts blocks outside pipelines; --strategy pipeline "
               "recomputes per micro-batch: never or always");
  CHORUS_CHECK(tc.batch_size > 0, "--batch-size must be positive, got ", tc.batch_size);
  CHORUS_CHECK(!tc.steps || *tc.steps > 0, "--steps must be positive, got ", tc.steps.value_or(0));
  CHORUS_CHECK(!tc.lr || (std::isfinite(*tc.lr) && *tc.lr >= 0), "--lr must be a non-negative number");
  CHORUS_CHECK(!tc.resume || tc.checkpoint_dir, "--resume needs --checkpoint-dir");
  CHORUS_CHECK(tc.log_every > 0, "--log-every must be positive, got ", tc.log_every);
  if (tc.trace) (void)parse_trace_steps(tc.trace_steps);
  if (g.mesh) {
    validate_gpt_mesh(tc, g);
    return;
  }
  CHORUS_CHECK(!g.sequence_parallel, "--sequence-parallel needs --mesh with tp > 1");
  CHORUS_CHECK(g.tp_chunks == 1, "--tp-chunks needs --mesh with tp > 1 and --sequence-parallel");
  if (tc.strategy == "ddp" || tc.strategy == "zero") ddp_launch_env(tc.strategy);
}

}  // namespace chorus::app
