// The GPT options of `chorus train` (train_gpt.h), beside cli.cpp's shared ones.
#include "cli_numbers.h"
#include "cli_options.h"
#include "memory_check.h"
#include "train_gpt.h"

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

}  // namespace chorus::app
