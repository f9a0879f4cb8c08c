#include "chorus/tensor_parallel/gpt.h"

#include "chorus/autograd/functions.h"
#include "chorus/core/error.h"
#include "chorus/nn/functional.h"
#include "chorus/nn/layers.h"
#include "chorus/nn/transformer_layers.h"
#include "chorus/ops/factory.h"
#include "chorus/tensor_parallel/cross_entropy.h"
#include "chorus/tensor_parallel/children.h"
#include "chorus/tensor_parallel/mappings.h"
#include "chorus/tensor_parallel/sp_linear.h"

namespace chorus::tp {

using detail::child;

namespace F = nn::functional;

namespace {

// Modules built without drawing random numbers: TensorParallelGPT loads the
// slices of a tp=1 model into them.
ParallelLinearOptions linear(int64_t in, int64_t out, int64_t blocks = 1) {
  return ParallelLinearOptions{in, out, true, blocks, Init::Zeros};
}

}  // namespace

void check_gpt_tp(const models::GPTConfig& c, int tp) {
  CHORUS_CHECK(tp >= 1, "tensor parallel: tp must be at least 1, got ", tp);
  CHORUS_CHECK(c.heads % tp == 0, "--mesh tp=", tp, ": the model's ", c.heads,
               " attention heads do not divide over ", tp, " tensor-parallel ranks (pick a tp that divides ", c.heads, ")");
  CHORUS_CHECK(c.padded_vocab % tp == 0, "--mesh tp=", tp, ": the vocabulary of ", c.padded_vocab,
               " rows does not divide over ", tp, " tensor-parallel ranks");
}

// ---- attention -------------------------------------------------------------

ParallelSelfAttention::ParallelSelfAttention(models::GPTConfig c, TPContext ctx)
    : Module("CausalSelfAttention"), cfg_(c), ctx_(std::move(ctx)) {
  check_gpt_tp(c, ctx_.size());
  register_module("c_attn", std::make_shared<ColumnParallelLinear>(linear(c.width, 3 * c.width, 3), ctx_));
  register_module("c_proj", std::make_shared<RowParallelLinear>(linear(c.width, c.width), ctx_));
}

Tensor ParallelSelfAttention::forward(const Tensor& x) {
  const int64_t heads = cfg_.heads / ctx_.size();
  // [B, T, 3 C/tp]: this rank's heads, whole sequence (Note [Rank-major activations]: in sequence order for attention)
  const int sp_tp = ctx_.sequence_parallel ? ctx_.size() : 1;
  Tensor qkv_all = rank_major_to_sequence(child(*this, "c_attn")->forward(x), sp_tp, ctx_.chunks);
  const double p_attn = is_training() ? cfg_.dropout : 0.0;
  Tensor y;
  {
    // The probabilities of this rank's heads: a mask of their own.
    std::optional<GeneratorGuard> heads_rng;
    if (p_attn > 0 && ctx_.sharded_rng) heads_rng.emplace(*ctx_.sharded_rng);
    y = F::causal_self_attention(qkv_all, heads, p_attn, cfg_.attention);  // [B, T, C/tp]
  }
  return parallel_dropout(child(*this, "c_proj")->forward(sequence_to_rank_major(y, sp_tp, ctx_.chunks)), cfg_.dropout,
                          is_training(), ctx_.sequence_parallel, ctx_);
}

std::shared_ptr<nn::Module> ParallelSelfAttention::make_empty() const {
  return std::make_shared<ParallelSelfAttention>(cfg_, ctx_);
}

// ---- MLP ---------------------------------------------------------------------

ParallelMLP::ParallelMLP(models::GPTConfig c, TPContext ctx) : Module("GPTMLP"), cfg_(c), ctx_(std::move(ctx)) {
  register_module("c_fc", std::make_shared<ColumnParallelLinear>(linear(c.width, 4 * c.width), ctx_));
  register_module("c_proj", std::make_shared<RowParallelLinear>(linear(4 * c.width, c.width), ctx_));
}

Tensor ParallelMLP::forward(const Tensor& x) {
  Tensor y;
  const std::vector<Tensor> fc = child(*this, "c_fc")->parameters(), proj = child(*this, "c_proj")->parameters();
  if (ctx_.sequence_parallel && is_parallel(ctx_.group) && x.dim() == 3 && fc.size() == 2 && proj.size() == 2) {
    // One op: gather, both products with GELU in their epilogues, reduce-scatter (tp::sp_mlp).
    y = sp_mlp(on_own_device(x), fc[0], fc[1], proj[0], proj[1], ctx_.group, ctx_.chunks);
  } else {
    Tensor h = F::gelu(child(*this, "c_fc")->forward(x), /*tanh_approximation=*/true);
    y = child(*this, "c_proj")->forward(h);
  }
  return parallel_dropout(y, cfg_.dropout, is_training(), ctx_.sequence_parallel, ctx_);
}

std::shared_ptr<nn::Module> ParallelMLP::make_empty() const { return std::make_shared<ParallelMLP>(cfg_, ctx_); }

// ---- block -------------------------------------------------------------------

ParallelGPTBlock::ParallelGPTBlock(models::GPTConfig c, TPContext ctx)
    : Module("GPTBlock"), cfg_(c), ctx_(std::move(ctx)) {
  register_module("ln_1", std::make_shared<ParallelLayerNorm>(c.width, ctx_));
  register_module("attn", std::make_shared<ParallelSelfAttention>(c, ctx_));
  register_module("ln_2", std::make_shared<ParallelLayerNorm>(c.width, ctx_));
  register_module("mlp", std::make_shared<ParallelMLP>(c, ctx_));
}

Tensor ParallelGPTBlock::forward(const Tensor& x) {
  Tensor h = chorus::add(x, child(*this, "attn")->forward(child(*this, "ln_1")->forward(x)));
  return chorus::add(h, child(*this, "mlp")->forward(child(*this, "ln_2")->forward(h)));
}

std::shared_ptr<nn::Module> ParallelGPTBlock::make_empty() const {
  return std::make_shared<ParallelGPTBlock>(cfg_, ctx_);
}

// ---- trunk -------------------------------------------------------------------

ParallelGPTTrunk::ParallelGPTTrunk(models::GPTConfig c, TPContext ctx)
    : Module("GPTTrunk"), cfg_(c), ctx_(std::move(ctx)) {
  c.validate();
  check_gpt_tp(c, ctx_.size());
  register_module("wte", std::make_shared<VocabParallelEmbedding>(
                             VocabParallelEmbeddingOptions{c.padded_vocab, c.width, Init::Zeros}, ctx_));
  register_module("wpe", std::make_shared<nn::Embedding>(nn::EmbeddingOptions{c.context, c.width}));
  auto h = std::make_shared<nn::Sequential>();
  for (int64_t i = 0; i < c.layers; ++i) h->push_back(std::make_shared<ParallelGPTBlock>(c, ctx_));
  register_module("h", h);
  register_module("ln_f", std::make_shared<ParallelLayerNorm>(c.width, ctx_));
}

Tensor embed_tokens(VocabParallelEmbedding& wte, nn::Embedding& wpe, const Tensor& ids, const models::GPTConfig& cfg,
                    const TPContext& ctx, bool training) {
  CHORUS_CHECK(ids.dim() == 2 && (ids.dtype() == kInt64 || ids.dtype() == kInt32),
               "GPT: expected token ids [batch, seq] of int64, got ", ids.describe());
  const int64_t t = ids.size(1);
  CHORUS_CHECK(t >= 1 && t <= cfg.context, "GPT: a sequence of ", t, " tokens does not fit the model's context of ",
               cfg.context, " positions");
  CHORUS_CHECK(!ctx.sequence_parallel || t % ctx.size() == 0, "GPT: sequence parallelism over tp=", ctx.size(),
               " needs a sequence length divisible by ", ctx.size(), ", got ", t);
  Tensor tok = wte.forward(ids);  // [B, T, C], or this rank's [B, T/tp, C]
  // Positions of this rank's rows of the residual stream.
  const int64_t rows = tok.size(1), first = ctx.sequence_parallel ? ctx.rank() * rows : 0;
  Tensor pos = arange(static_cast<double>(first), static_cast<double>(first + rows), 1.0, {kInt64, tok.device()});
  Tensor x = chorus::add(tok, F::embedding(replicated_param(wpe.weight(), ctx), pos));
  return parallel_dropout(x, cfg.dropout, training, ctx.sequence_parallel, ctx);
}

Tensor logits_of_hidden(const Tensor& h, VocabParallelEmbedding& wte, const TPContext& ctx) {
  // Every rank multiplies the whole sequence by its vocabulary rows.
  Tensor full = ctx.sequence_parallel ? gather_from_sp(h, ctx.group, 1) : copy_to_tp(h, ctx.group);
  return F::linear(full, wte.weight(), Tensor());  // tied: the token embedding is the output projection
}

Tensor ParallelGPTTrunk::forward(const Tensor& ids) {
  Tensor x = embed_tokens(*child<VocabParallelEmbedding>(*this, "wte"), *child<nn::Embedding>(*this, "wpe"), ids, cfg_,
                          ctx_, is_training());
  for (const auto& [n, block] : child(*this, "h")->named_children()) x = block->forward(x);
  return child(*this, "ln_f")->forward(x);
}

std::shared_ptr<nn::Module> ParallelGPTTrunk::make_empty() const {
  return std::make_shared<ParallelGPTTrunk>(cfg_, ctx_);
}

// ---- the model ---------------------------------------------------------------

TensorParallelGPT::TensorParallelGPT(models::GPTConfig c, TPContext ctx, std::optional<NamedTensors> init)
    : Module("GPT"), cfg_(c), ctx_(std::move(ctx)) {
  c.validate();
  check_gpt_tp(c, ctx_.size());
  // The tree's own layers draw nothing that stays (nn::Embedding's N(0, 1)
  // for wpe is overwritten): put the generator back, so that what is drawn
  // after this model (dropout) matches the tp=1 run.
  const RngState before = default_generator().state();
  register_module("transformer", std::make_shared<ParallelGPTTrunk>(c, ctx_));
  default_generator().set_state(before);
  if (init) load_full_state_dict(*this, *init, ctx_.group);
}

// GPT-2's initialisation, exactly: the tp=1 model's weights (drawn first, as
// at tp=1), sliced.
TensorParallelGPT::TensorParallelGPT(models::GPTConfig c, TPContext ctx)
    : TensorParallelGPT(c, std::move(ctx), models::GPT(c).state_dict()) {}

Tensor TensorParallelGPT::forward(const Tensor& ids) {
  auto trunk = child(*this, "transformer");
  return logits_of_hidden(trunk->forward(ids), *child<VocabParallelEmbedding>(*trunk, "wte"), ctx_);
}

Tensor TensorParallelGPT::gather_logits(const Tensor& local_logits) const {
  return gather_from_tp(local_logits, ctx_.group, -1);
}

Tensor TensorParallelGPT::loss_of_logits(const Tensor& local_logits, const Tensor& targets,
                                         std::optional<int64_t> ignore_index) const {
  return vocab_parallel_cross_entropy(local_logits, targets, cfg_.vocab, ctx_.group, ignore_index);
}

std::shared_ptr<nn::Module> TensorParallelGPT::make_empty() const {
  return std::shared_ptr<TensorParallelGPT>(new TensorParallelGPT(cfg_, ctx_, std::nullopt));
}

}  // namespace chorus::tp
