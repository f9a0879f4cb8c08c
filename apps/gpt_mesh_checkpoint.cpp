#include "gpt_mesh_checkpoint.h"

#include <map>

#include "chorus/autograd/grad_mode.h"
#include "chorus/core/error.h"
#include "chorus/core/rng.h"
#include "chorus/models/gpt.h"
#include "chorus/tensor_parallel/shard.h"

namespace chorus::app {

namespace {

// The spec of optimizer-state entry `name` ("param.<i>.<buffer>" follows
// parameter i; "step", "lr" and "param.<i>.step" are replicated).
tp::ShardSpec spec_of_state(const std::string& name, const std::vector<tp::ShardedParameter>& params) {
  if (name.rfind("param.", 0) != 0) return {};
  const size_t dot = name.find('.', 6);
  if (dot == std::string::npos || name.substr(dot + 1) == "step") return {};
  const size_t i = std::stoul(name.substr(6, dot - 6));
  CHORUS_CHECK(i < params.size(), "checkpoint: optimizer state '", name, "' names parameter ", i, " of ",
               params.size());
  return params[i].spec;
}

// A models::GPT and an AdamW over its parameters in the order the mesh
// run's optimizer has them (named_parameters), on the CPU.
struct FullPair {
  std::shared_ptr<models::GPT> model;
  std::unique_ptr<optim::AdamW> opt;
};
FullPair full_pair(const models::GPTConfig& cfg, const optim::AdamWOptions& options) {
  FullPair f;
  // Its initial weights are overwritten: draw them without moving the run's
  // generator (dropout after a save must not depend on the save).
  const RngState before = default_generator().state();
  f.model = std::make_shared<models::GPT>(cfg);
  default_generator().set_state(before);
  std::vector<Tensor> params;
  for (auto& [name, p] : f.model->named_parameters()) params.push_back(p);
  f.opt = std::make_unique<optim::AdamW>(params, options);
  return f;
}

}  // namespace

std::string save_mesh_checkpoint(const std::string& dir, tp::TensorParallelGPT& model, optim::AdamW& opt,
                                 const io::TrainingState& state, bool writer) {
  const auto& group = model.context().group;
  const auto params = tp::sharded_parameters(model);
  CHORUS_ASSERT(params.size() == opt.params().size());
  NamedTensors weights = tp::full_state_dict(model, group);
  NamedTensors moments;
  {
    NoGradGuard no_grad;
    for (const auto& [name, t] : opt.state()) moments.emplace_back(name, tp::unshard(t.contiguous(), spec_of_state(name, params), group));
  }
  if (!writer) return "";
  FullPair f = full_pair(model.config(), opt.options());
  f.model->load_state_dict(weights);
  f.opt->load_state(moments);
  return io::save_checkpoint(dir, *f.model, *f.opt, state);
}

io::TrainingState load_mesh_checkpoint(const std::string& ckpt, tp::TensorParallelGPT& model, optim::AdamW& opt,
                                       const std::function<void(const io::TrainingState&, const std::string&)>& check) {
  FullPair f = full_pair(model.config(), opt.options());
  io::TrainingState st = io::load_checkpoint(ckpt, *f.model, *f.opt, check);
  const auto& group = model.context().group;
  tp::load_full_state_dict(model, f.model->state_dict(), group);
  const auto params = tp::sharded_parameters(model);
  const int ranks = model.context().size(), rank = model.context().rank();
  NamedTensors mine;
  for (const auto& [name, t] : f.opt->state()) mine.emplace_back(name, tp::shard_of(t, spec_of_state(name, params), rank, ranks));
  opt.load_state(mine);
  return st;
}

}  // namespace chorus::app
