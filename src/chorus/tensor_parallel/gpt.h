// The GPT of models/gpt.h split over a tensor-parallel group (Megatron-LM's
// GPT): per block, attention's c_attn column-parallel (each rank computes its
// heads' q, k, v: Note [Blocked shards]) and c_proj row-parallel, the MLP's
// c_fc column-parallel and c_proj row-parallel; the token embedding, which
// is also the output projection, vocabulary-parallel, and the loss the
// vocabulary-parallel cross entropy (full logits never exist). With sequence
// parallelism the residual stream, the LayerNorms and the dropouts between
// the parallel regions hold [B, T/tp, C] per rank.
//
// The module tree and state-dict names are models::GPT's (Note [GPT
// parameter names]); each parameter is this rank's shard. A model built at
// tp=N from a seed holds the slices of the weights models::GPT(cfg) draws at
// tp=1 from the same seed (it builds that model once and slices it), so the
// two compute the same function: tests/distributed/tensor_parallel.sh checks it.
#pragma once

#include <optional>

#include "chorus/models/gpt.h"
#include "chorus/nn/transformer_layers.h"
#include "chorus/tensor_parallel/layers.h"

namespace chorus::tp {

// Throws ValueError, one line naming the option to change, when the model
// cannot be split over `tp` ranks (heads, or the padded vocabulary, not
// divisible by tp).
void check_gpt_tp(const models::GPTConfig& c, int tp);

class ParallelSelfAttention : public nn::Module {
 public:
  ParallelSelfAttention(models::GPTConfig c, TPContext ctx);
  Tensor forward(const Tensor& x) override;

 protected:
  std::shared_ptr<nn::Module> make_empty() const override;

 private:
  models::GPTConfig cfg_;
  TPContext ctx_;
};

class ParallelMLP : public nn::Module {
 public:
  ParallelMLP(models::GPTConfig c, TPContext ctx);
  Tensor forward(const Tensor& x) override;

 protected:
  std::shared_ptr<nn::Module> make_empty() const override;

 private:
  models::GPTConfig cfg_;
  TPContext ctx_;
};

class ParallelGPTBlock : public nn::Module {
 public:
  ParallelGPTBlock(models::GPTConfig c, TPContext ctx);
  Tensor forward(const Tensor& x) override;

 protected:
  std::shared_ptr<nn::Module> make_empty() const override;

 private:
  models::GPTConfig cfg_;
  TPContext ctx_;
};

// ids [B, T] (the same on every tensor rank) -> hidden states [B, T, C]
// (sequence parallel: this rank's chunk [B, T/tp, C]).
class ParallelGPTTrunk : public nn::Module {
 public:
  ParallelGPTTrunk(models::GPTConfig c, TPContext ctx);
  Tensor forward(const Tensor& ids) override;

 protected:
  std::shared_ptr<nn::Module> make_empty() const override;

 private:
  models::GPTConfig cfg_;
  TPContext ctx_;
};

// The two ends of the trunk, shared with the pipeline's layers
// (gpt_layers.h): token ids -> the residual stream (the embeddings, their
// dropout), and the final hidden states (after ln_f) -> this rank's
// vocabulary slice of the logits (the tied output projection).
Tensor embed_tokens(VocabParallelEmbedding& wte, nn::Embedding& wpe, const Tensor& ids, const models::GPTConfig& cfg,
                    const TPContext& ctx, bool training);
Tensor logits_of_hidden(const Tensor& h, VocabParallelEmbedding& wte, const TPContext& ctx);

class TensorParallelGPT : public nn::Module {
 public:
  // Draws models::GPT(c)'s initial weights (the generator advances as it
  // would at tp=1) and keeps this rank's slices.
  TensorParallelGPT(models::GPTConfig c, TPContext ctx);
  // ids [B, T] -> this rank's vocabulary slice of the logits [B, T, padded_vocab / tp].
  Tensor forward(const Tensor& ids) override;
  // The full logits [B, T, padded_vocab] from forward()'s slices (collective;
  // for generation and tests: training never needs them).
  Tensor gather_logits(const Tensor& local_logits) const;
  // Mean cross entropy of forward()'s logits against targets [B, T], as
  // models::GPT::loss_of_logits, vocabulary-parallel.
  Tensor loss_of_logits(const Tensor& local_logits, const Tensor& targets,
                        std::optional<int64_t> ignore_index = std::nullopt) const;
  Tensor loss(const Tensor& ids, const Tensor& targets, std::optional<int64_t> ignore_index = std::nullopt) {
    return loss_of_logits(forward(ids), targets, ignore_index);
  }
  const models::GPTConfig& config() const { return cfg_; }
  const TPContext& context() const { return ctx_; }

 protected:
  std::shared_ptr<nn::Module> make_empty() const override;

 private:
  // init: a tp=1 state dict to slice, or none (zeros; clone() copies values in).
  TensorParallelGPT(models::GPTConfig c, TPContext ctx, std::optional<NamedTensors> init);
  models::GPTConfig cfg_;
  TPContext ctx_;
};

}  // namespace chorus::tp
