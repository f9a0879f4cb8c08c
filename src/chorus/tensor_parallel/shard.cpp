#include "chorus/tensor_parallel/shard.h"

#include <map>
#include <set>

#include "chorus/autograd/grad_mode.h"
#include "chorus/core/error.h"
#include "chorus/tensor_parallel/mappings.h"

namespace chorus::tp {

namespace {

// `t` with `dim` moved to the front and split as [blocks, rest of dim 0, ...].
Tensor blocked_front(const Tensor& t, const ShardSpec& spec) {
  Tensor f = t.transpose(0, spec.dim).contiguous();
  CHORUS_CHECK(f.size(0) % spec.blocks == 0, "tensor parallel: ", spec.blocks, " blocks do not divide dim ",
               spec.dim, " of ", t.describe());
  Shape s = f.sizes();
  s[0] /= spec.blocks;
  s.insert(s.begin(), spec.blocks);
  return f.reshape(s);
}

void walk(nn::Module& m, const std::string& prefix, std::set<const TensorImpl*>& seen,
          std::vector<ShardedParameter>& out) {
  const auto* sharded = dynamic_cast<const ShardedModule*>(&m);
  for (auto& [name, p] : m.own_parameters()) {
    if (!seen.insert(p.impl()).second) continue;  // shared: listed once, under its first name
    out.push_back({prefix + name, p, sharded ? sharded->shard_spec(name) : ShardSpec{}});
  }
  for (auto& [name, child] : m.own_children()) walk(*child, prefix + name + ".", seen, out);
}

}  // namespace

Tensor shard_of(const Tensor& full, const ShardSpec& spec, int rank, int ranks) {
  if (spec.replicated() || ranks == 1) return full.contiguous().clone();
  Tensor b = blocked_front(full, spec);  // [blocks, n, ...]
  CHORUS_CHECK(b.size(1) % ranks == 0, "tensor parallel: dim ", spec.dim, " of ", full.describe(),
               " does not divide over ", ranks, " ranks");
  const int64_t len = b.size(1) / ranks;
  Tensor mine = b.narrow(1, rank * len, len).contiguous();  // [blocks, len, ...]
  Shape s(mine.sizes().begin() + 1, mine.sizes().end());
  s[0] *= spec.blocks;
  return mine.reshape(s).transpose(0, spec.dim).contiguous();
}

Tensor unshard(const Tensor& local, const ShardSpec& spec, const dist::ProcessGroupPtr& group) {
  if (spec.replicated() || !is_parallel(group)) return local;
  Tensor b = blocked_front(local, spec);  // [blocks, len, ...]
  Tensor all = all_gather_along(b.contiguous(), group, 1);  // [blocks, ranks * len, ...]
  Shape s(all.sizes().begin() + 1, all.sizes().end());
  s[0] *= spec.blocks;
  return all.reshape(s).transpose(0, spec.dim).contiguous();
}

std::vector<ShardedParameter> sharded_parameters(nn::Module& m) {
  std::vector<ShardedParameter> out;
  std::set<const TensorImpl*> seen;
  walk(m, "", seen, out);
  return out;
}

NamedTensors full_state_dict(nn::Module& m, const dist::ProcessGroupPtr& group) {
  NoGradGuard no_grad;
  NamedTensors out;
  for (const auto& p : sharded_parameters(m)) out.emplace_back(p.name, unshard(p.tensor.detach(), p.spec, group));
  for (const auto& [name, b] : m.named_buffers()) out.emplace_back(name, b.detach());
  return out;
}

void load_full_state_dict(nn::Module& m, const NamedTensors& full, const dist::ProcessGroupPtr& group) {
  const int ranks = is_parallel(group) ? group->size() : 1, rank = is_parallel(group) ? group->rank() : 0;
  std::map<std::string, Tensor> given(full.begin(), full.end());
  NoGradGuard no_grad;
  std::set<std::string> used;
  auto take = [&](const std::string& name, Tensor& dst, const ShardSpec& spec) {
    auto it = given.find(name);
    CHORUS_CHECK(it != given.end(), "tensor-parallel load: the state has no tensor '", name, "'");
    Shape expect = dst.sizes();
    if (!spec.replicated()) expect[spec.dim] *= ranks;
    CHORUS_CHECK(it->second.sizes() == expect, "tensor-parallel load: '", name, "' is ", shape_str(it->second.sizes()),
                 ", the model at tp=1 has ", shape_str(expect));
    dst.copy_(shard_of(it->second, spec, rank, ranks));
    used.insert(name);
  };
  for (auto& p : sharded_parameters(m)) take(p.name, p.tensor, p.spec);
  for (auto& [name, b] : m.named_buffers()) take(name, b, ShardSpec{});
  for (const auto& [name, t] : given)
    CHORUS_CHECK(used.count(name), "tensor-parallel load: unexpected tensor '", name, "' (another model?)");
}

}  // namespace chorus::tp
