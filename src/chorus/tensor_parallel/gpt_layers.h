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
