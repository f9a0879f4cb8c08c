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

#include <memory>

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

}  // namespace chorus::models
