// The tensor-parallel GPT laid out flat for parallel::Pipeline (tensor x
// pipeline parallelism): [embeddings, block 0, ..., block L-1, head], the
// layers sharing the model's modules (so TensorParallelGPT's state-dict names,
// full_state_dict and load_full_state_dict still speak of the same tensors).
// Each pipeline stage is a run of these layers; each stage's rank is itself a
// rank of a tensor-parallel group.
//
// Note [Tied embeddings across stages]: the head's output projection is the
// token embedding, which the first stage uses too. Over processes each stage's
// rank holds its own copy of it (every rank builds the whole model), and the
// two copies see different halves of the gradient: the first stage's from
// the lookup, the last stage's from the logits. sync_tied_embedding sums
// them over the pipeline group after each backward (Megatron-LM's embedding
// group), so both copies take the same optimizer step and stay equal; the
// global gradient norm counts the copy once (clip_grad_norm_'s
// counted_elsewhere). This is for stages over processes (Pipeline's
// stage_group); in one process the two stages would share one tensor, which
// models::GPTPipelineLayers handles for the plain GPT.
#pragma once

#include <map>
#include <memory>
#include <vector>

#include "chorus/distributed/process_group.h"
#include "chorus/nn/layers.h"
#include "chorus/tensor_parallel/gpt.h"

namespace chorus::tp {

// ids [B, T] -> the residual stream ([B, T, C], or [B, T/tp, C] sequence parallel).
class ParallelGPTEmbeddings : public nn::Module {
 public:
  ParallelGPTEmbeddings(std::shared_ptr<VocabParallelEmbedding> wte, std::shared_ptr<nn::Embedding> wpe,
                        models::GPTConfig cfg, TPContext ctx);
  Tensor forward(const Tensor& ids) override;

 protected:
  std::shared_ptr<nn::Module> make_empty() const override;

 private:
  std::shared_ptr<VocabParallelEmbedding> wte_;
  std::shared_ptr<nn::Embedding> wpe_;
  models::GPTConfig cfg_;
  TPContext ctx_;
};

// The residual stream -> ln_f -> this rank's vocabulary slice of the logits.
class ParallelGPTHead : public nn::Module {
 public:
  ParallelGPTHead(nn::ModulePtr ln_f, std::shared_ptr<VocabParallelEmbedding> wte, TPContext ctx);
  Tensor forward(const Tensor& h) override;

 protected:
  std::shared_ptr<nn::Module> make_empty() const override;

 private:
  nn::ModulePtr ln_f_;
  std::shared_ptr<VocabParallelEmbedding> wte_;
  TPContext ctx_;
};

std::shared_ptr<nn::Sequential> pipeline_layers(TensorParallelGPT& model);

// Note [Pipeline stages by cost]: pipeline_layers' layers are not alike. A
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
// time being 0.83 of the slowest's. pipeline_balance splits the layers by
// these costs instead. One stage a rank (1F1B, GPipe): the least slowest
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
std::vector<double> pipeline_layer_costs(const models::GPTConfig& cfg, int64_t seq);
// ranks x virtual_stages counts of consecutive layers adding up to
// cfg.layers + 2 (stage s on pipeline rank s % ranks). ValueError when there
// are more stages than layers.
std::vector<int64_t> pipeline_balance(const models::GPTConfig& cfg, int64_t seq, int64_t ranks,
                                      int64_t virtual_stages = 1);

// The token embedding (Note [Tied embeddings across stages]).
Tensor& tied_embedding(TensorParallelGPT& model);

// Sums the token embedding's gradient over `pp_group` (ranks whose stages do
// not use it add zeros): collective over the pipeline group, after the
// backward and before clipping and the optimizer step.
void sync_tied_embedding(TensorParallelGPT& model, bool used_here, const dist::ProcessGroupPtr& pp_group);

// Data parallelism over pipelines of tensor-parallel stages, once per
// optimizer step (after every accumulated step's backward; Pipeline's own
// data_group instead averages each stage during its step's backward): each
// gradient of `params` averaged over `dp_group` (one all-reduce per dtype,
// the gradients packed; no overlap with the backward). Collective over
// `dp_group`.
void average_gradients(const std::vector<Tensor>& params, const dist::ProcessGroupPtr& dp_group);

}  // namespace chorus::tp
