#include "chorus/models/gpt.h"

#include "chorus/autograd/grad_mode.h"
#include "chorus/nn/checkpoint.h"

#include <cmath>
#include <map>
#include <set>
#include <tuple>
#include <utility>

#include "chorus/autograd/functions.h"
#include "chorus/autograd/grad_mode.h"
#include "chorus/core/error.h"
#include "chorus/nn/functional.h"
#include "chorus/nn/init.h"
#include "chorus/ops/factory.h"

namespace chorus::models {

namespace {

// layers, heads, width (../shared/bench/torch_gpt.py's table; dN as llm.c's descriptors; d2 and d4,
// not llm.c's, are small models for tests and CPU runs).
struct Size {
  int64_t layers, heads, width;
};
const std::map<std::string, Size>& sizes() {
  static const std::map<std::string, Size> s = {
      {"gpt2", {12, 12, 768}},  {"gpt2-medium", {24, 16, 1024}}, {"gpt2-large", {36, 20, 1280}},
      {"gpt2-xl", {48, 25, 1600}}, {"d2", {2, 2, 128}},           {"d4", {4, 4, 256}}, {"d6", {6, 6, 384}},           {"d12", {12, 12, 768}},
      {"d24", {24, 16, 1024}},  {"d36", {36, 20, 1280}},          {"d48", {48, 25, 1600}},
      {"d60", {60, 30, 1920}},  {"d72", {72, 30, 2880}},          {"d84", {84, 32, 3072}}};
  return s;
}

using nn::child_as;

nn::ModulePtr child_named(const nn::Module& m, const std::string& name) { return child_as<nn::Module>(m, name); }

Tensor residual_dropout(const Tensor& x, double p, bool training) {
  return p > 0 ? nn::functional::dropout(x, p, training) : x;
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// The Linear weights that Hugging Face stores as Conv1D ([in, out]).
bool is_conv1d_weight(const std::string& name) {
  return ends_with(name, "attn.c_attn.weight") || ends_with(name, "attn.c_proj.weight") ||
         ends_with(name, "mlp.c_fc.weight") || ends_with(name, "mlp.c_proj.weight");
}

}  // namespace

GPTConfig GPTConfig::named(const std::string& name, int64_t vocab, int64_t context) {
  auto it = sizes().find(name);
  if (it == sizes().end()) {
    std::string known;
    for (const auto& n : names()) known += (known.empty() ? "" : ", ") + n;
    CHORUS_THROW(ValueError, "unknown GPT model '", name, "' (known: ", known, ")");
  }
  GPTConfig c;
  c.layers = it->second.layers;
  c.heads = it->second.heads;
  c.width = it->second.width;
  c.vocab = vocab;
  c.padded_vocab = (vocab + 127) / 128 * 128;
  c.context = context;
  return c;
}

std::vector<std::string> GPTConfig::names() {
  return {"gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "d2",  "d4",  "d6",
          "d12",  "d24",         "d36",        "d48",     "d60", "d72", "d84"};
}

bool GPTConfig::is_gpt_name(const std::string& name) { return sizes().count(name) != 0; }

void GPTConfig::validate() const {
  CHORUS_CHECK(layers >= 1 && heads >= 1 && width >= 1, "GPT: layers, heads and width must be positive, got ",
               layers, ", ", heads, ", ", width);
  CHORUS_CHECK(width % heads == 0, "GPT: ", heads, " heads do not divide the width ", width);
  CHORUS_CHECK(vocab >= 1 && padded_vocab >= vocab, "GPT: vocabulary ", vocab, " (padded ", padded_vocab,
               ") is not valid");
  CHORUS_CHECK(context >= 1, "GPT: the context must be at least one position, got ", context);
  CHORUS_CHECK(dropout >= 0 && dropout < 1, "GPT: dropout must be in [0, 1), got ", dropout);
}

int64_t GPTConfig::num_parameters() const {
  const int64_t c = width;
  const int64_t block = 2 * 2 * c + (c * 3 * c + 3 * c) + (c * c + c) + (c * 4 * c + 4 * c) + (4 * c * c + c);
  return padded_vocab * c + context * c + layers * block + 2 * c;
}

double GPTConfig::flops_per_token(int64_t seq) const {
  return 6.0 * static_cast<double>(num_parameters()) + 6.0 * static_cast<double>(layers * width * seq);
}

CausalSelfAttention::CausalSelfAttention(GPTConfig c) : Module("CausalSelfAttention"), cfg_(c) {
  register_module("c_attn", std::make_shared<nn::Linear>(c.width, 3 * c.width));
  register_module("c_proj", std::make_shared<nn::Linear>(c.width, c.width));
}

Tensor CausalSelfAttention::forward(const Tensor& x) {
  CHORUS_CHECK(x.dim() == 3 && x.size(2) == cfg_.width, "CausalSelfAttention: expected [batch, seq, ", cfg_.width,
               "], got ", x.describe());
  Tensor y = nn::functional::causal_self_attention(child_named(*this, "c_attn")->forward(x), cfg_.heads,
                                                   is_training() ? cfg_.dropout : 0.0, cfg_.attention);
  return residual_dropout(child_named(*this, "c_proj")->forward(y), cfg_.dropout, is_training());
}

GPTMLP::GPTMLP(GPTConfig c) : Module("GPTMLP"), cfg_(c) {
  register_module("c_fc", std::make_shared<nn::Linear>(c.width, 4 * c.width));
  register_module("c_proj", std::make_shared<nn::Linear>(4 * c.width, c.width));
}

Tensor GPTMLP::forward(const Tensor& x) {
  // One op for the two products and GELU (their epilogues carry it: Note
  // [GELU in the MLP's epilogues] in cuda/blas/gemm.cpp), read through the
  // Linear modules' parameters so names, placement and clones stay theirs.
  auto* fc = dynamic_cast<nn::Linear*>(child_named(*this, "c_fc").get());
  auto* proj = dynamic_cast<nn::Linear*>(child_named(*this, "c_proj").get());
  Tensor y;
  if (fc && proj && fc->bias().defined() && proj->bias().defined() && x.device() == fc->weight().device() &&
      x.device() == proj->weight().device()) {
    y = nn::functional::mlp_gelu(x, fc->weight(), fc->bias(), proj->weight(), proj->bias(), cfg_.recompute_gelu);
  } else {
    Tensor h = nn::functional::gelu(child_named(*this, "c_fc")->forward(x), /*tanh_approximation=*/true);
    y = child_named(*this, "c_proj")->forward(h);
  }
  return residual_dropout(y, cfg_.dropout, is_training());
}

GPTBlock::GPTBlock(GPTConfig c) : Module("GPTBlock"), cfg_(c) {
  register_module("ln_1", std::make_shared<nn::LayerNorm>(nn::LayerNormOptions{c.width}));
  register_module("attn", std::make_shared<CausalSelfAttention>(c));
  register_module("ln_2", std::make_shared<nn::LayerNorm>(nn::LayerNormOptions{c.width}));
  register_module("mlp", std::make_shared<GPTMLP>(c));
}

std::pair<Tensor, Tensor> GPTBlock::forward_pending(const Tensor& residual, const Tensor& branch) {
  // Note [Pending residual] in gpt.h.
  auto& ln_1 = *child_as<nn::LayerNorm>(*this, "ln_1");
  auto& ln_2 = *child_as<nn::LayerNorm>(*this, "ln_2");
  Tensor x = residual, n1;
  if (branch.defined()) {
    std::tie(x, n1) = ln_1.forward_add(residual, branch);
  } else {
    n1 = ln_1.forward(residual);
  }
  auto [h, n2] = ln_2.forward_add(x, child_named(*this, "attn")->forward(n1));
  return {h, child_named(*this, "mlp")->forward(n2)};
}

Tensor GPTBlock::forward(const Tensor& x) {
  auto [h, m] = forward_pending(x, Tensor());
  return chorus::add(h, m);
}

nn::Value GPTBlock::forward_value(const nn::Value& x) {
  if (x.is_tensor()) return nn::Value(forward(x.tensor()));
  CHORUS_CHECK(x.is_list() && x.list().size() == 2, "GPTBlock: expected a tensor or {residual, branch}");
  auto [h, m] = forward_pending(x[0].tensor(), x[1].tensor());
  return nn::Value::List{nn::Value(h), nn::Value(m)};
}

Tensor gpt_embed(nn::Embedding& wte, nn::Module& wpe, Tensor& positions, const Tensor& ids, double dropout,
                 bool training) {
  const int64_t t = ids.size(1);
  Tensor tok = wte.forward(ids.to(wte.weight().device()));
  // The positions 0..T-1, made once per device and length: arange builds them
  // on the host, which a captured step (Note [Graphed step]) cannot replay.
  if (!positions.defined() || positions.device() != tok.device() || positions.numel() != t)
    positions = arange(t, {kInt64, tok.device()});
  Tensor x = chorus::add(tok, wpe.forward(positions));
  return residual_dropout(x, dropout, training);
}

GPTTrunk::GPTTrunk(GPTConfig c) : Module("GPTTrunk"), cfg_(c) {
  c.validate();
  register_module("wte", std::make_shared<nn::Embedding>(nn::EmbeddingOptions{c.padded_vocab, c.width}));
  register_module("wpe", std::make_shared<nn::Embedding>(nn::EmbeddingOptions{c.context, c.width}));
  auto h = std::make_shared<nn::Sequential>();
  for (int64_t i = 0; i < c.layers; ++i) h->push_back(std::make_shared<GPTBlock>(c));
  register_module("h", h);
  register_module("ln_f", std::make_shared<nn::LayerNorm>(nn::LayerNormOptions{c.width}));
}

Tensor GPTTrunk::forward(const Tensor& ids) {
  CHORUS_CHECK(ids.dim() == 2 && (ids.dtype() == kInt64 || ids.dtype() == kInt32),
               "GPT: expected token ids [batch, seq] of int64, got ", ids.describe());
  const int64_t t = ids.size(1);
  CHORUS_CHECK(t >= 1 && t <= cfg_.context, "GPT: a sequence of ", t, " tokens does not fit the model's context of ",
               cfg_.context, " positions");
  Tensor x = gpt_embed(*child_as<nn::Embedding>(*this, "wte"), *child_named(*this, "wpe"), positions_, ids, cfg_.dropout,
                       is_training());
  // --recompute: a recomputed block keeps only its input and runs again in
  // the backward (Note [Recomputed blocks] in nn/checkpoint.cpp).
  //
  // Note [Recomputing some blocks]: --recompute N recomputes the first N
  // blocks only (Megatron-LM's "block" granularity), so a run that fits
  // without recomputing every block pays for the recomputation of only as
  // many as its memory needs (--recompute auto picks the fewest by the memory
  // plan, apps/memory_check.h). Which N blocks does not change the peak:
  // every block's activations live together at the end of the forward; the
  // first N, as Megatron-LM's block method counts them.
  const int64_t recomputed = is_training() && grad_enabled() ? cfg_.recomputed_blocks() : 0;
  // Note [Pending residual]: the stream is x + branch, the add left for the
  // next norm. A block seen as one tensor in and one out (recomputed) gets
  // the sum; a wrapper in the block's slot under its name (ZeRO's units)
  // gets the pair as a Value.
  Tensor branch;
  int64_t i = 0;
  for (const auto& [n, block] : child_named(*this, "h")->named_children()) {
    const bool recompute = i++ < recomputed;
    auto* b = dynamic_cast<GPTBlock*>(block.get());
    if (b && !recompute) {
      std::tie(x, branch) = b->forward_pending(x, branch);
      continue;
    }
    if (!b && !recompute && block->type_name() == "GPTBlock") {
      const nn::Value out = block->forward_value(nn::Value::List{nn::Value(x), nn::Value(branch)});
      x = out[0].tensor();
      branch = out[1].tensor();
      continue;
    }
    if (branch.defined()) x = chorus::add(x, branch);
    branch = Tensor();
    x = recompute ? nn::checkpoint(*block, x) : block->forward(x);
  }
  auto& ln_f = *child_as<nn::LayerNorm>(*this, "ln_f");
  return branch.defined() ? ln_f.forward_add(x, branch).second : ln_f.forward(x);
}

GPT::GPT(GPTConfig c) : Module("GPT"), cfg_(c) {
  c.validate();
  register_module("transformer", std::make_shared<GPTTrunk>(c));
  // GPT-2's initialisation (as llm.c and torch_gpt.py).
  const double proj_std = 0.02 / std::sqrt(2.0 * static_cast<double>(c.layers));
  NoGradGuard no_grad;
  for (auto& [name, p] : named_parameters()) {
    if (p.dim() == 2) {
      nn::init::normal_(p, 0.0, ends_with(name, "c_proj.weight") ? proj_std : 0.02);
    } else if (ends_with(name, ".bias")) {
      nn::init::constant_(p, 0.0);
    }
  }
  // The padding rows of the vocabulary are never looked up and get no
  // gradient from the classifier: zero, so exports and imports agree.
  if (c.padded_vocab > c.vocab) wte().narrow(0, c.vocab, c.padded_vocab - c.vocab).zero_();
}

std::vector<nn::ModulePtr> GPT::blocks() const {
  std::vector<nn::ModulePtr> out;
  for (const auto& [n, block] : child_named(*child_named(*this, "transformer"), "h")->named_children()) out.push_back(block);
  return out;
}

Tensor& GPT::wte() {
  auto trunk = child_as<GPTTrunk>(*this, "transformer");
  return child_as<nn::Embedding>(*trunk, "wte")->weight();
}

Tensor GPT::forward(const Tensor& ids) {
  Tensor h = child_named(*this, "transformer")->forward(ids);
  return nn::functional::linear(h, wte(), Tensor());  // tied: the output projection is the token embedding
}

Tensor GPT::loss_of_logits(const Tensor& logits, const Tensor& targets, std::optional<int64_t> ignore_index,
                           bool discard_logits) const {
  return nn::functional::cross_entropy_fused(logits, targets, cfg_.vocab, ignore_index, discard_logits);
}

Tensor GPT::loss(const Tensor& ids, const Tensor& targets, std::optional<int64_t> ignore_index) {
  return loss_of_logits(forward(ids), targets, ignore_index, /*discard_logits=*/true);
}

NamedTensors gpt_to_hf(const NamedTensors& state, const GPTConfig& cfg) {
  NamedTensors out;
  for (const auto& [name, t] : state) {
    Tensor v = t.detach();
    if (name == "transformer.wte.weight") v = v.narrow(0, 0, cfg.vocab);
    if (is_conv1d_weight(name)) v = v.t();
    out.emplace_back(name, v.contiguous());
  }
  return out;
}

NamedTensors gpt_from_hf(const NamedTensors& hf, const GPTConfig& cfg) {
  GPT shape_model(cfg);  // names and shapes to expect (small for the configs tests import)
  std::map<std::string, Tensor> given;
  for (const auto& [name, t] : hf) {
    if (name == "lm_head.weight") continue;  // tied: the same values as the token embedding
    if (ends_with(name, ".attn.bias") || ends_with(name, ".attn.masked_bias")) continue;  // causal-mask buffers
    given[name] = t;
  }
  NamedTensors out;
  std::set<std::string> used;
  for (const auto& [name, mine] : shape_model.state_dict()) {
    auto it = given.find(name);
    CHORUS_CHECK(it != given.end(), "GPT import: the file has no tensor '", name, "'");
    Tensor v = it->second.detach().to(mine.dtype());
    if (is_conv1d_weight(name)) v = v.t();
    if (name == "transformer.wte.weight" && v.size(0) < mine.size(0) && v.dim() == 2 && v.size(1) == mine.size(1)) {
      Tensor padded = zeros(mine.sizes(), {mine.dtype(), v.device()});
      padded.narrow(0, 0, v.size(0)).copy_(v);
      v = padded;
    }
    CHORUS_CHECK(v.sizes() == mine.sizes(), "GPT import: '", name, "' is ", shape_str(it->second.sizes()),
                 " in the file, the model needs ", shape_str(is_conv1d_weight(name) ? mine.t().sizes() : mine.sizes()));
    out.emplace_back(name, v.contiguous());
    used.insert(name);
  }
  for (const auto& [name, t] : given) {
    CHORUS_CHECK(used.count(name), "GPT import: unexpected tensor '", name, "' in the file (another model?)");
  }
  return out;
}

}  // namespace chorus::models
