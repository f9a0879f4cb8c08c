#include "gpt_mesh_checkpoint.h"

#include <map>

#include "chorus/autograd/grad_mode.h"
#include "chorus/core/error.h"
#include "chorus/core/rng.h"
#include "chorus/models/gpt.h"
#include "chorus/ops/factory.h"
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

// The full shape of a shard of `local`'s shape.
Shape full_shape(const Tensor& local, const tp::ShardSpec& spec, int ranks) {
  Shape s = local.sizes();
  if (!spec.replicated()) s[static_cast<size_t>(spec.dim)] *= ranks;
  return s;
}

// The full tensor of shard `local` from pipeline rank `owner`: gathered over
// the owner stage's tensor group there, then broadcast over the pipeline
// group (every rank gets it, on the group's device).
Tensor from_stage(const Tensor& local, const tp::ShardSpec& spec, int owner, const StageOwners& st,
                  const dist::ProcessGroupPtr& tp_group) {
  const Device dev = st.pp_group->device();
  Tensor full = st.pp_group->rank() == owner
                    ? tp::unshard(local.contiguous(), spec, tp_group).to(dev).contiguous()
                    : empty(full_shape(local, spec, tp_group->size()), {local.dtype(), dev});
  st.pp_group->broadcast(full, owner)->wait();
  return full.to(cpu_device());
}

// The weights and AdamW state of a model split over pipeline stages, in the
// one-process names (Note [Mesh checkpoints]). A parameter's state exists iff
// its own step count (broadcast first) is above 0.
void gather_stages(tp::TensorParallelGPT& model, optim::AdamW& opt, const std::vector<tp::ShardedParameter>& params,
                   const StageOwners& st, NamedTensors& weights, NamedTensors& moments) {
  const auto& tpg = model.context().group;
  CHORUS_CHECK(st.owner.size() == params.size(), "checkpoint: ", st.owner.size(), " owners for ", params.size(),
               " parameters");
  const NamedTensors local = opt.state();
  std::map<std::string, Tensor> by_name(local.begin(), local.end());
  // The buffers' names (AdamW: exp_avg, exp_avg_sq): those of the first
  // parameter of this stage that has state (every optimizer entry is
  // "step", "lr" or "param.<i>.<name>").
  std::vector<std::string> buffers;
  std::string first;
  for (const auto& [name, t] : local) {
    if (name.rfind("param.", 0) != 0) continue;
    const size_t dot = name.find('.', 6);
    if (first.empty()) first = name.substr(0, dot + 1);
    if (name.substr(0, dot + 1) == first && name.substr(dot + 1) != "step") buffers.push_back(name.substr(dot + 1));
  }
  moments.emplace_back("step", by_name.at("step"));
  moments.emplace_back("lr", by_name.at("lr"));
  NoGradGuard no_grad;
  const Device dev = st.pp_group->device();
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    const int owner = st.owner[i];
    const bool mine = st.pp_group->rank() == owner;
    weights.emplace_back(p.name, from_stage(p.tensor.detach(), p.spec, owner, st, tpg));
    const std::string prefix = "param." + std::to_string(i) + ".";
    const auto step_it = by_name.find(prefix + "step");
    Tensor step = mine && step_it != by_name.end() ? step_it->second.to(dev).reshape({1}).contiguous()
                                                   : zeros({1}, {kInt64, dev});
    st.pp_group->broadcast(step, owner)->wait();
    const int64_t n = step.to(cpu_device()).to_vector<int64_t>()[0];
    if (n == 0) continue;
    moments.emplace_back(prefix + "step", step.to(cpu_device()).reshape({}));
    CHORUS_CHECK(!buffers.empty(), "checkpoint: parameter ", i, " has optimizer state but this stage's have none");
    for (const std::string& b : buffers) {
      const auto it = by_name.find(prefix + b);
      CHORUS_CHECK(!mine || it != by_name.end(), "checkpoint: optimizer state ", prefix + b, " is missing");
      const Tensor shard = mine ? it->second : p.tensor.detach();  // elsewhere: only its shape and dtype count
      moments.emplace_back(prefix + b, from_stage(shard, p.spec, owner, st, tpg));
    }
  }
  for (const auto& [name, b] : model.named_buffers()) weights.emplace_back(name, b.detach().to(cpu_device()));
}

}  // namespace

std::string save_mesh_checkpoint(const std::string& dir, tp::TensorParallelGPT& model, optim::AdamW& opt,
                                 const io::TrainingState& state, bool writer, const StageOwners* stages) {
  const auto& group = model.context().group;
  const auto params = tp::sharded_parameters(model);
  CHORUS_ASSERT(params.size() == opt.params().size());
  NamedTensors weights, moments;
  if (stages) {
    gather_stages(model, opt, params, *stages, weights, moments);
  } else {
    weights = tp::full_state_dict(model, group);
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
