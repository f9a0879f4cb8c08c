#include "chorus/tensor_parallel/gpt_layers.h"

#include "chorus/autograd/grad_mode.h"
#include "chorus/core/error.h"
#include "chorus/ops/factory.h"
#include "chorus/tensor_parallel/children.h"
#include "chorus/tensor_parallel/mappings.h"

namespace chorus::tp {

using detail::child;

ParallelGPTEmbeddings::ParallelGPTEmbeddings(std::shared_ptr<VocabParallelEmbedding> wte,
                                             std::shared_ptr<nn::Embedding> wpe, models::GPTConfig cfg, TPContext ctx)
    : Module("GPTEmbeddings"), wte_(std::move(wte)), wpe_(std::move(wpe)), cfg_(cfg), ctx_(std::move(ctx)) {
  register_module("wte", wte_);
  register_module("wpe", wpe_);
}

Tensor ParallelGPTEmbeddings::forward(const Tensor& ids) {
  return embed_tokens(*wte_, *wpe_, ids, cfg_, ctx_, is_training());
}

std::shared_ptr<nn::Module> ParallelGPTEmbeddings::make_empty() const {
  CHORUS_THROW(ValueError, "GPTEmbeddings: a pipeline layer of a tensor-parallel GPT shares the model's modules; "
                           "clone the model instead");
}

ParallelGPTHead::ParallelGPTHead(nn::ModulePtr ln_f, std::shared_ptr<VocabParallelEmbedding> wte, TPContext ctx)
    : Module("GPTHead"), ln_f_(std::move(ln_f)), wte_(std::move(wte)), ctx_(std::move(ctx)) {
  register_module("ln_f", ln_f_);
  register_module("wte", wte_);
}

Tensor ParallelGPTHead::forward(const Tensor& h) { return logits_of_hidden(ln_f_->forward(h), *wte_, ctx_); }

std::shared_ptr<nn::Module> ParallelGPTHead::make_empty() const {
  CHORUS_THROW(ValueError, "GPTHead: a pipeline layer of a tensor-parallel GPT shares the model's modules; "
                           "clone the model instead");
}

std::shared_ptr<nn::Sequential> pipeline_layers(TensorParallelGPT& model) {
  auto trunk = child(model, "transformer");
  auto wte = child<VocabParallelEmbedding>(*trunk, "wte");
  auto layers = std::make_shared<nn::Sequential>();
  layers->push_back(std::make_shared<ParallelGPTEmbeddings>(wte, child<nn::Embedding>(*trunk, "wpe"), model.config(),
                                                            model.context()));
  for (const auto& [n, block] : child(*trunk, "h")->named_children()) layers->push_back(block);
  layers->push_back(std::make_shared<ParallelGPTHead>(child(*trunk, "ln_f"), wte, model.context()));
  return layers;
}

Tensor& tied_embedding(TensorParallelGPT& model) {
  return child<VocabParallelEmbedding>(*child(model, "transformer"), "wte")->weight();
}

void sync_tied_embedding(TensorParallelGPT& model, bool used_here, const dist::ProcessGroupPtr& pp_group) {
  if (!is_parallel(pp_group)) return;
  Tensor& w = tied_embedding(model);
  NoGradGuard no_grad;
  // A stage without the embedding may hold it on the host (only its own stage
  // moved to the device): its zeros go where the group's collectives run.
  Tensor g = used_here && w.grad().defined() ? w.grad().contiguous()
                                             : zeros(w.sizes(), {w.dtype(), used_here ? w.device() : pp_group->device()});
  all_reduce_sum(g, pp_group);
  if (used_here) w.set_grad(g);
}

void average_gradients(const std::vector<Tensor>& params, const dist::ProcessGroupPtr& dp_group) {
  if (!is_parallel(dp_group)) return;
  NoGradGuard no_grad;
  // One flat buffer per dtype, in the order of `params` (the same on every rank).
  std::map<DType, std::vector<Tensor>> by_dtype;
  for (const Tensor& p : params) {
    CHORUS_CHECK(p.grad().defined(), "average_gradients: a parameter ", p.describe(),
                 " has no gradient (every data rank must produce each one)");
    by_dtype[p.grad().dtype()].push_back(p);
  }
  for (auto& [dtype, ps] : by_dtype) {
    int64_t total = 0;
    for (const Tensor& p : ps) total += p.grad().numel();
    Tensor flat = empty({total}, {dtype, ps.front().grad().device()});
    int64_t at = 0;
    for (const Tensor& p : ps) {
      flat.narrow(0, at, p.grad().numel()).copy_(p.grad().reshape({p.grad().numel()}));
      at += p.grad().numel();
    }
    dp_group->all_reduce(flat, dist::ReduceOp::Avg)->wait();
    at = 0;
    for (const Tensor& p : ps) {
      Tensor g = p.grad();
      g.copy_(flat.narrow(0, at, g.numel()).reshape(g.sizes()));
      at += g.numel();
    }
  }
}

}  // namespace chorus::tp
