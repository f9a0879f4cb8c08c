// A GPT laid out for parallel::Pipeline: blocks as stages.
//
// Note [GPT as pipeline stages]: the layers are [embeddings, block 0, ...,
// block L-1, head] -- the GPT's own modules (the embeddings' and the final
// norm's are shared with the model, so its state dict, checkpoints and
// Hugging Face export stay as they are), except for the output projection.
// That is tied to the token embedding, which the first stage holds and the
// last stage needs on another device; as Megatron-LM does, the head keeps its
// own copy of the embedding matrix, equal to it at all times: after each
// backward, merge_tied_gradients() adds the head's gradient into the
// embedding's (the one tensor the optimizer, clipping and checkpoints see)
// and drops the head's; after each optimizer step (and after loading
// weights), sync_tied_weights() copies the embedding into the head.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "chorus/models/gpt.h"
#include "chorus/nn/layers.h"

namespace chorus::models {

// The first stage: ids [B, T] -> token + position embeddings [B, T, C].
class GPTEmbedStage : public nn::Module {
 public:
  // With the model's own embeddings; the one-argument form (clones) makes fresh ones.
  GPTEmbedStage(GPTConfig c, std::shared_ptr<nn::Embedding> wte, nn::ModulePtr wpe);
  explicit GPTEmbedStage(GPTConfig c);
  Tensor forward(const Tensor& ids) override;
  GPTConfig options_for_clone() const { return cfg_; }
  CHORUS_MODULE_CLONEABLE(GPTEmbedStage)

 private:
  GPTConfig cfg_;
  Tensor positions_;
};

// The last stage: hidden states [B, T, C] -> logits [B, T, padded_vocab]
// through the final norm and the head's copy of the token embedding.
class GPTHeadStage : public nn::Module {
 public:
  // The model's final norm and a copy of `wte`; the one-argument form (clones)
  // a fresh norm and a zero matrix.
  GPTHeadStage(GPTConfig c, nn::ModulePtr ln_f, const Tensor& wte);
  explicit GPTHeadStage(GPTConfig c);
  Tensor forward(const Tensor& h) override;
  Tensor& weight() { return own_parameters()[0].second; }
  GPTConfig options_for_clone() const { return cfg_; }
  CHORUS_MODULE_CLONEABLE(GPTHeadStage)

 private:
  GPTConfig cfg_;
};

class GPTPipelineLayers {
 public:
  explicit GPTPipelineLayers(const std::shared_ptr<GPT>& model);
  const std::shared_ptr<nn::Sequential>& layers() const { return layers_; }
  // After the backward: the embedding's gradient += the head's (moved to the
  // embedding's device); the head's dropped.
  void merge_tied_gradients();
  // The head's copy takes the embedding's values (after a step or a load).
  void sync_tied_weights();

 private:
  std::shared_ptr<GPT> model_;
  std::shared_ptr<GPTHeadStage> head_;
  std::shared_ptr<nn::Sequential> layers_;
};

// Note [Pipeline stages by cost]: a pipelined GPT's layers (tp::pipeline_layers,
// GPTEmbedStage ... GPTHeadStage) are not alike. A
// block costs 72 C^2 + 6 C T floating-point operations a token (forward and
// backward, GPTConfig::flops_per_token's count), the head 6 C Vp (the tied
// classifier over the padded vocabulary; for gpt2-xl 2.5 blocks, for gpt2
// 4.9), the embeddings next to nothing (a lookup and its scatter). Split
// evenly by layer count (Pipeline's default), gpt2-xl's 50 layers over 4
// stages were 13, 13, 12, 12: the last stage held 11 blocks and the head,
// 13.5 blocks' work against the others' 12-13, and every stage waits for the
// slowest in 1F1B's steady state. On 4 x H200 (session 37, call 1) the
// measured step was 0.99 (1F1B) and 0.96 (interleaved) of the slowest
// stage's busy time over 1 - the ideal bubble: the bubble above the ideal
// (0.304 against 0.158) was that stage's extra work, the mean stage's busy
// time being 0.83 of the slowest's. parallel::balance_ranks splits the layers
// by these costs instead (chorus train --mesh and chorus bench --mesh, and
// chorus plan to predict them). One stage a rank (1F1B, GPipe): the least slowest
// stage (parallel::balance_by_cost), and among the splits under it the most
// even (the least sum of squares), a tie going to the one whose later
// stages are lighter. gpt2-xl at pp=4: 14, 13, 12, 11 (13, 13, 12 blocks,
// then 10 and the head: 12.5). Interleaved (V stages a rank), each rank's V
// stages together are what count; the cuts go where each stage's share of
// the work is nearest 1/(pp V) (gpt2-xl at pp=4, V=2: the slowest rank 13
// blocks' work, 13.5 by count). The per-layer costs do not depend on tp
// (every layer is split tp ways alike).
// What the FLOP count misses: the head's loss also passes over the [tokens,
// Vp] logits several times (memory-bound; chorus plan counts it, Note [Cost
// model]), and the embeddings' gradient is a dense [Vp, C] sum on CPUs
// where it is slow; the costs are a first-principles default, not a
// measurement (--balance sets any split; timing the layers, as
// --strategy pipeline's --balance time does in one process, is not done
// over processes).
// The layers' costs in that order -- embeddings, cfg.layers blocks, head --
// for sequences of `seq` tokens: floating-point operations a token.
std::vector<double> pipeline_layer_costs(const GPTConfig& cfg, int64_t seq);

}  // namespace chorus::models
