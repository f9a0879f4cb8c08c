#include "chorus/tensor_parallel/gpt_layers.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "chorus/autograd/grad_mode.h"
#include "chorus/core/error.h"
#include "chorus/ops/factory.h"
#include "chorus/parallel/placement.h"
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

std::vector<double> pipeline_layer_costs(const models::GPTConfig& cfg, int64_t seq) {
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

namespace {

// The work of each rank's stages (stage s on rank s % ranks).
std::vector<double> rank_loads(const std::vector<double>& costs, const std::vector<int64_t>& balance, int64_t ranks) {
  std::vector<double> load(static_cast<size_t>(ranks), 0.0);
  size_t l = 0;
  for (size_t s = 0; s < balance.size(); ++s)
    for (int64_t i = 0; i < balance[s]; ++i) load[s % static_cast<size_t>(ranks)] += costs[l++];
  return load;
}

double slowest(const std::vector<double>& loads) { return *std::max_element(loads.begin(), loads.end()); }

}  // namespace

std::vector<int64_t> pipeline_balance(const models::GPTConfig& cfg, int64_t seq, int64_t ranks, int64_t virtual_stages) {
  CHORUS_CHECK(ranks >= 1 && virtual_stages >= 1, "pipeline_balance: ", ranks, " ranks x ", virtual_stages,
               " stages each");
  const std::vector<double> costs = pipeline_layer_costs(cfg, seq);
  const int64_t stages = ranks * virtual_stages, n = static_cast<int64_t>(costs.size());
  CHORUS_CHECK(stages <= n, "pipeline_balance: ", stages, " stages but the model has only ", n,
               " pipeline layers (embeddings, ", cfg.layers, " blocks, head)");
  std::vector<int64_t> balance;
  std::vector<double> prefix(static_cast<size_t>(n) + 1, 0.0);
  for (int64_t i = 0; i < n; ++i) prefix[static_cast<size_t>(i) + 1] = prefix[static_cast<size_t>(i)] + costs[static_cast<size_t>(i)];
  if (virtual_stages == 1) {
    // The least slowest stage (exact), then among the splits under it the
    // most even one: the least sum of the stages' squared costs (exact, by
    // dynamic programming over the same cuts), a tie going to the split whose
    // later stages are lighter (Note [Pipeline stages by cost]).
    const double cap = slowest(rank_loads(costs, parallel::balance_by_cost(costs, stages), ranks)) * (1 + 1e-12);
    const double inf = std::numeric_limits<double>::infinity();
    const size_t N = static_cast<size_t>(n) + 1;
    std::vector<std::vector<double>> best(static_cast<size_t>(stages) + 1, std::vector<double>(N, inf));
    std::vector<std::vector<int64_t>> cut(static_cast<size_t>(stages) + 1, std::vector<int64_t>(N, 0));
    best[0][0] = 0;
    for (int64_t p = 1; p <= stages; ++p)
      for (int64_t i = p; i <= n; ++i)
        for (int64_t j = p - 1; j < i; ++j) {
          const double part = prefix[static_cast<size_t>(i)] - prefix[static_cast<size_t>(j)];
          const double prev = best[static_cast<size_t>(p - 1)][static_cast<size_t>(j)];
          if (part > cap || prev == inf) continue;
          const double v = prev + part * part;
          double& b = best[static_cast<size_t>(p)][static_cast<size_t>(i)];
          // A later cut on a tie (within rounding): this last part the lighter.
          if (v <= b * (1 + 1e-12) || b == inf) b = v, cut[static_cast<size_t>(p)][static_cast<size_t>(i)] = j;
        }
    balance.assign(static_cast<size_t>(stages), 0);
    for (int64_t p = stages, i = n; p >= 1; --p) {
      const int64_t j = cut[static_cast<size_t>(p)][static_cast<size_t>(i)];
      balance[static_cast<size_t>(p - 1)] = i - j;
      i = j;
    }
    return balance;
  }
  // Several stages a rank (interleaved): what counts is each rank's stages
  // together, which the least slowest single stage does not even out (its
  // cap rounded up on every stage adds up on a rank). Instead each cut goes
  // to the layer boundary nearest its share of the total work, k / stages
  // (each stage at least one layer; on a tie the later boundary); the even
  // split by count is kept where that is no better.
  int64_t prev = 0;
  for (int64_t k = 1; k < stages; ++k) {
    const double target = prefix.back() * static_cast<double>(k) / static_cast<double>(stages);
    int64_t cut = prev + 1;
    for (int64_t i = prev + 1; i <= n - (stages - k); ++i)
      if (std::abs(prefix[static_cast<size_t>(i)] - target) <= std::abs(prefix[static_cast<size_t>(cut)] - target)) cut = i;
    balance.push_back(cut - prev);
    prev = cut;
  }
  balance.push_back(n - prev);
  std::vector<int64_t> even(static_cast<size_t>(stages), n / stages);
  for (int64_t i = 0; i < n % stages; ++i) ++even[static_cast<size_t>(i)];
  return slowest(rank_loads(costs, balance, ranks)) < slowest(rank_loads(costs, even, ranks)) ? balance : even;
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
