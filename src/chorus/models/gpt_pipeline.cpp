// A GPT as pipeline stages (Note [GPT as pipeline stages] in gpt_pipeline.h).
#include "chorus/models/gpt_pipeline.h"

#include "chorus/autograd/grad_mode.h"
#include "chorus/core/error.h"
#include "chorus/nn/functional.h"
#include "chorus/nn/transformer_layers.h"
#include "chorus/ops/factory.h"

namespace chorus::models {


GPTEmbedStage::GPTEmbedStage(GPTConfig c, std::shared_ptr<nn::Embedding> wte, nn::ModulePtr wpe)
    : Module("GPTEmbedStage"), cfg_(c) {
  register_module("wte", std::move(wte));
  register_module("wpe", std::move(wpe));
}

GPTEmbedStage::GPTEmbedStage(GPTConfig c)
    : GPTEmbedStage(c, std::make_shared<nn::Embedding>(nn::EmbeddingOptions{c.padded_vocab, c.width}),
                    std::make_shared<nn::Embedding>(nn::EmbeddingOptions{c.context, c.width})) {}

Tensor GPTEmbedStage::forward(const Tensor& ids) {
  CHORUS_CHECK(ids.dim() == 2 && ids.size(1) >= 1 && ids.size(1) <= cfg_.context, "GPT: expected token ids [batch, seq] ",
               "with seq up to the context of ", cfg_.context, ", got ", ids.describe());
  return gpt_embed(*nn::child_as<nn::Embedding>(*this, "wte"), *nn::child_as<nn::Module>(*this, "wpe"), positions_, ids,
                   cfg_.dropout, is_training());
}

GPTHeadStage::GPTHeadStage(GPTConfig c)
    : GPTHeadStage(c, std::make_shared<nn::LayerNorm>(nn::LayerNormOptions{c.width}), zeros({c.padded_vocab, c.width})) {}

GPTHeadStage::GPTHeadStage(GPTConfig c, nn::ModulePtr ln_f, const Tensor& wte) : Module("GPTHeadStage"), cfg_(c) {
  NoGradGuard no_grad;
  register_parameter("weight", wte.detach().clone());
  register_module("ln_f", std::move(ln_f));
}

Tensor GPTHeadStage::forward(const Tensor& h) {
  return nn::functional::linear(nn::child_as<nn::Module>(*this, "ln_f")->forward(h), weight(), Tensor());
}

GPTPipelineLayers::GPTPipelineLayers(const std::shared_ptr<GPT>& model) : model_(model) {
  CHORUS_CHECK(model != nullptr, "GPT pipeline: the model is null");
  auto trunk = nn::child_as<GPTTrunk>(*model, "transformer");
  layers_ = std::make_shared<nn::Sequential>();
  layers_->train(model->is_training());
  layers_->push_back(std::make_shared<GPTEmbedStage>(model->config(), nn::child_as<nn::Embedding>(*trunk, "wte"),
                                                     nn::child_as<nn::Module>(*trunk, "wpe")));
  for (const auto& [n, block] : nn::child_as<nn::Module>(*trunk, "h")->named_children()) layers_->push_back(block);
  head_ = std::make_shared<GPTHeadStage>(model->config(), nn::child_as<nn::Module>(*trunk, "ln_f"), model->wte());
  layers_->push_back(head_);
}

void GPTPipelineLayers::merge_tied_gradients() {
  NoGradGuard no_grad;
  Tensor& w = model_->wte();
  Tensor& h = head_->weight();
  Tensor hg = h.grad();
  if (!hg.defined()) return;
  Tensor moved = hg.to(w.device(), w.dtype());
  Tensor wg = w.grad();
  w.set_grad(wg.defined() ? wg.add(moved) : moved);
  h.set_grad(Tensor());
}

void GPTPipelineLayers::sync_tied_weights() {
  NoGradGuard no_grad;
  head_->weight().copy_(model_->wte());
}

std::vector<double> pipeline_layer_costs(const GPTConfig& cfg, int64_t seq) {
  CHORUS_CHECK(seq >= 1, "pipeline_layer_costs: the sequence length must be >= 1, got ", seq);
  // Note [Pipeline stages by cost]: FLOPs a token, forward and backward.
  const double c = static_cast<double>(cfg.width), t = static_cast<double>(seq);
  const double block = 72.0 * c * c + 6.0 * c * t;
  const double head = 6.0 * c * static_cast<double>(cfg.padded_vocab);
  std::vector<double> costs(static_cast<size_t>(cfg.layers) + 2, block);
  costs.front() = 0.0;  // the embeddings
  costs.back() = head;
  return costs;
}

}  // namespace chorus::models
