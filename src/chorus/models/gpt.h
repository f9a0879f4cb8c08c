// GPT-2 (Radford et al. 2019) as karpathy/llm.c and nanoGPT train it:
// pre-LayerNorm blocks (attention, then a GELU-tanh MLP of 4x the width),
// learned positions, the output projection tied to the token embedding, the
// vocabulary padded to a multiple of 128 (50257 -> 50304) for the matrix
// products, GPT-2's initialisation (N(0, 0.02); the residual projections
// scaled by 1/sqrt(2 * layers); biases 0).
//
// Note [GPT parameter names]: the module tree is Hugging Face's
// (transformer.wte, transformer.h.0.attn.c_attn, ...), so state_dict names are
// the names of a Hugging Face GPT-2 `model.safetensors`. The layouts differ
// in one way: Linear weights are [out, in] here and Conv1D's [in, out] there;
// gpt_to_hf / gpt_from_hf transpose them (and cut or pad the vocabulary).
#pragma once

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "chorus/nn/layers.h"
#include "chorus/ops/transformer.h"
#include "chorus/nn/transformer_layers.h"

namespace chorus::models {

struct GPTConfig {
  int64_t layers = 12, heads = 12, width = 768;
  int64_t vocab = 50257;         // tokens the data can hold
  int64_t padded_vocab = 50304;  // rows of the embedding (vocab rounded up to 128)
  int64_t context = 1024;        // positions
  double dropout = 0.0;          // on the embeddings, the residual branches and the attention probabilities
  // The attention kernels (ops/transformer.h): the fused (flash) kernel where
  // the device has one, else the composite of two products and a softmax.
  ops::AttentionKernel attention = ops::AttentionKernel::Auto;
  // Activation recomputation in training (nn/checkpoint.h): the first
  // recompute_blocks blocks keep their input only and run their forward again
  // in the backward; the others keep their activations (0: none, the default;
  // `layers` or more: every block, --recompute always). Note [Recomputing
  // some blocks] in gpt.cpp says why the first ones.
  int64_t recompute_blocks = 0;
  // The blocks that recompute, clamped to [0, layers].
  int64_t recomputed_blocks() const { return recompute_blocks <= 0 ? 0 : std::min(recompute_blocks, layers); }
  bool recomputes_every_block() const { return recomputed_blocks() == layers; }
  // The MLP keeps GELU's input only and its backward computes GELU again
  // (--recompute-gelu; Note [GELU recomputed in the backward] in
  // autograd/nn_functions.cpp): a quarter less of what a block keeps.
  bool recompute_gelu = false;
  // gpt2, gpt2-medium, gpt2-large, gpt2-xl, or llm.c's dN (d6, d12, ..., d84).
  // vocab and context as given. Throws ValueError naming the known names.
  static GPTConfig named(const std::string& name, int64_t vocab = 50257, int64_t context = 1024);
  static std::vector<std::string> names();
  static bool is_gpt_name(const std::string& name);
  // Throws ValueError for a configuration that cannot be built (heads not dividing the width, ...).
  void validate() const;
  int64_t head_dim() const { return width / heads; }
  // Parameters, the tied embedding counted once.
  int64_t num_parameters() const;
  // Training FLOPs per token, llm.c's count: 6 * parameters + 6 * layers * width * seq.
  double flops_per_token(int64_t seq) const;
};

class CausalSelfAttention : public nn::Module {
 public:
  explicit CausalSelfAttention(GPTConfig c);
  Tensor forward(const Tensor& x) override;  // [B, T, C] -> [B, T, C]
  GPTConfig options_for_clone() const { return cfg_; }
  CHORUS_MODULE_CLONEABLE(CausalSelfAttention)
 private:
  GPTConfig cfg_;
};

class GPTMLP : public nn::Module {
 public:
  explicit GPTMLP(GPTConfig c);
  Tensor forward(const Tensor& x) override;
  GPTConfig options_for_clone() const { return cfg_; }
  CHORUS_MODULE_CLONEABLE(GPTMLP)
 private:
  GPTConfig cfg_;
};

// h = x + attn(ln_1(x)); out = h + mlp(ln_2(h)), the first add fused with
// ln_2 (Note [Residual add beside layer norm] in ops/transformer.h).
class GPTBlock : public nn::Module {
 public:
  explicit GPTBlock(GPTConfig c);
  Tensor forward(const Tensor& x) override;
  // Note [Pending residual]: the block's input given as residual + branch
  // (branch undefined: the input is residual) and its output returned the
  // same way, (h, mlp(ln_2(h))), so that each add at a block boundary is
  // fused with the norm after it (the next block's ln_1, or ln_f). forward(x)
  // is forward_pending(x, {}) with the last add done apart: the path of
  // callers that see a block as one tensor in, one out (--recompute's
  // checkpoint, pipeline stages). forward_value takes and returns the pair
  // as a 2-list {residual, branch} (a tensor: as forward), so that a wrapper
  // in the block's slot that passes Values on and answers to the block's
  // type name (ZeRO's units: Note [Sharded units] in
  // data_parallel/sharded.h) keeps the adds fused.
  std::pair<Tensor, Tensor> forward_pending(const Tensor& residual, const Tensor& branch);
  nn::Value forward_value(const nn::Value& x) override;
  GPTConfig options_for_clone() const { return cfg_; }
  CHORUS_MODULE_CLONEABLE(GPTBlock)
 private:
  GPTConfig cfg_;
};

// The embeddings, the blocks and the final norm ("transformer."): ids [B, T]
// -> hidden states [B, T, C].
class GPTTrunk : public nn::Module {
 public:
  explicit GPTTrunk(GPTConfig c);
  Tensor forward(const Tensor& ids) override;
  GPTConfig options_for_clone() const { return cfg_; }
  CHORUS_MODULE_CLONEABLE(GPTTrunk)
 private:
  GPTConfig cfg_;
  Tensor positions_;  // 0..T-1 on the embedding's device (not state: made from T)
};

class GPT : public nn::Module {
 public:
  explicit GPT(GPTConfig c);
  // ids [B, T] (int64, T <= context) -> logits [B, T, padded_vocab].
  Tensor forward(const Tensor& ids) override;
  // Mean cross entropy (nats per token) of the next tokens `targets` [B, T]
  // through the fused classifier (padding columns left out; targets equal to
  // ignore_index, when given, left out of the mean).
  Tensor loss(const Tensor& ids, const Tensor& targets, std::optional<int64_t> ignore_index = std::nullopt);
  // The loss of logits that forward() returned. discard_logits: the
  // classifier's gradient is written over them (a logits-sized buffer
  // saved: the largest of a GPT's step), for a caller that keeps none.
  Tensor loss_of_logits(const Tensor& logits, const Tensor& targets,
                        std::optional<int64_t> ignore_index = std::nullopt, bool discard_logits = false) const;
  const GPTConfig& config() const { return cfg_; }
  // The token embedding, which is also the output projection.
  Tensor& wte();
  // The transformer blocks, in order (ZeRO stage 3 shards each as a unit).
  std::vector<nn::ModulePtr> blocks() const;
  GPTConfig options_for_clone() const { return cfg_; }
  CHORUS_MODULE_CLONEABLE(GPT)
 private:
  GPTConfig cfg_;
};

// The token and position embeddings of ids [B, T] (with dropout p in
// training): what GPTTrunk and the pipeline's first stage compute. `positions`
// caches 0..T-1 on the embedding's device.
Tensor gpt_embed(nn::Embedding& wte, nn::Module& wpe, Tensor& positions, const Tensor& ids, double dropout,
                 bool training);

// Note [GPT parameter names]: Chorus's state dict of a GPT -> Hugging Face's
// layout (Conv1D weights transposed, the vocabulary cut to cfg.vocab), and back
// (vocabulary rows past the file's padded with zeros; the causal-mask buffers
// old checkpoints carry, "*.attn.bias" of [1, 1, n, n], skipped). gpt_from_hf
// throws ValueError naming a missing, unexpected or mis-shaped tensor.
NamedTensors gpt_to_hf(const NamedTensors& state, const GPTConfig& cfg);
NamedTensors gpt_from_hf(const NamedTensors& hf, const GPTConfig& cfg);

}  // namespace chorus::models
