// What a GPT holds in memory, computed from its configuration alone (no model
// is built): the parameter counts a memory plan needs (data_parallel/memory_plan.h) and
// the activations one micro-batch keeps for its backward.
//
// Note [GPT activation count]: what our implementation saves, per block, for
// N = batch * seq tokens of width C in the compute dtype of s bytes (2 under
// bf16 autocast, 4 in float32):
//   ln_1: its input (the residual stream x) and its output      2 N C s
//         mean and rstd, float32                                2 N * 4
//   c_attn's output qkv (q, k, v are views of it, kept by attention) 3 N C s
//   attention: its output (c_proj's input too on the fused path)  N C s
//         fused: one log-sum-exp per row, float32           B H T * 4
//         composite: the probabilities [B H, T, T] and the merged-heads
//         copy c_proj reads                        B H T T s + N C s
//   ln_2: its input h (x plus attention) and its output          2 N C s
//         mean and rstd                                         2 N * 4
//   the MLP (mlp_gelu): the pre-activation and GELU output    2 * 4 N C s
//         (--recompute-gelu: the pre-activation only, 4 N C s, and the
//         recomputed output in the block's backward)
// so 16 N C s + 16 N (+ attention's) a block; c_proj's outputs and the
// residual sums are read once and freed. A recomputed block (--recompute)
// keeps its input (N C s) and the backward holds one block's full set at a time.
// The embeddings keep the ids and targets and the lookups' indices (int64).
// The head keeps ln_f's input and output, and the fused classifier's
// gradient of the logits [N, Vp] (s bytes); the peak comes as it runs:
// logits and their gradient both live (2 N Vp s) at the end of the forward,
// or early in the backward the logits' gradient beside the tied embedding's
// 16-bit weight gradient and its float32 cast (N Vp s + Vp C (s + 4)).
// A block's backward adds its gradients' transients (the MLP's first: about
// 10 N C s and c_fc's weight gradient); with --recompute they and the
// recomputed block's set are the peak, else the classifier's usually is.
// Allocator rounding, library workspaces and the few small transients are the
// plan's reserve (Note [Memory plan reserve] in data_parallel/memory_plan.h), not here.
#pragma once

#include <cstdint>

#include "chorus/models/gpt.h"

namespace chorus::models {

struct GPTActivationBytes {
  int64_t embeddings = 0;  // ids, targets and the lookups' saved indices
  int64_t blocks = 0;      // what the blocks keep (Note [GPT activation count])
  // The moment of the peak on top: ln_f and the classifier's logits, or a
  // block's backward (with --recompute, the recomputed block's set too).
  int64_t peak = 0;
  int64_t total() const { return embeddings + blocks + peak; }
};

// One micro-batch of `batch` sequences of `seq` tokens; bf16: under autocast;
// fused_attention: the flash kernel runs (ops::AttentionKernel's rules: CUDA,
// 16-bit, head_dim <= 128, no dropout); cfg.recompute_blocks and cfg.dropout as set.
// logits_overwritten: the loss writes the classifier's gradient over the
// logits (GPT::loss, the trainer's step: GPT::loss_of_logits' discard_logits),
// not beside them (a pipeline's last stage, which returns its output).
GPTActivationBytes gpt_activation_bytes(const GPTConfig& cfg, int64_t batch, int64_t seq, bool bf16,
                                        bool fused_attention, bool logits_overwritten = true);
// The classifier's logits at their peak (part of `peak`): DataParallel gathers every
// replica's logits on the first device, which adds this per extra replica.
int64_t gpt_logits_bytes(const GPTConfig& cfg, int64_t batch, int64_t seq, bool bf16,
                         bool logits_overwritten = true);

// Parameters autocast keeps a 16-bit copy of (Note [Autocast weight copies]):
// every Linear's weight and bias and the tied embedding (the classifier's
// weight); not the position embedding or the norms.
int64_t gpt_autocast_copied_parameters(const GPTConfig& cfg);
// One transformer block's parameters (a ZeRO-3 unit), and the root unit's
// (the embeddings and the final norm, gathered for the whole step).
int64_t gpt_block_parameters(const GPTConfig& cfg);
int64_t gpt_root_parameters(const GPTConfig& cfg);

}  // namespace chorus::models
