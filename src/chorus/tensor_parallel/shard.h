// How a tensor-parallel parameter relates to the full tensor of the model at
// tp=1, and the two directions between them: a rank's shard of a full tensor
// (initialisation, loading a checkpoint), and the full tensor gathered from
// the ranks' shards (saving one).
//
// Note [Blocked shards]: a fused matrix such as attention's c_attn, [3C, C]
// for q, k and v stacked, is split block by block: rank r holds rows
// [r C/tp, (r+1) C/tp) of each of q, k and v (so its heads' q, k, v), stored
// as the three pieces stacked, [3C/tp, C]. ShardSpec::blocks = 3 says so; a
// plain column- or row-parallel matrix has blocks = 1.
#pragma once

#include <string>
#include <vector>

#include "chorus/core/tensor.h"
#include "chorus/distributed/process_group.h"
#include "chorus/nn/module.h"

namespace chorus::tp {

struct ShardSpec {
  int64_t dim = -1;    // the split dimension; -1: replicated (every rank holds the full tensor)
  int64_t blocks = 1;  // Note [Blocked shards]
  bool replicated() const { return dim < 0; }
};

// Rank `rank` of `ranks`'s shard of `full` (a contiguous copy). Throws
// ValueError when the split dimension does not divide.
Tensor shard_of(const Tensor& full, const ShardSpec& spec, int rank, int ranks);
// The full tensor from every rank's `local` shard (collective over `group`;
// `local` itself for a replicated spec or a group of one).
Tensor unshard(const Tensor& local, const ShardSpec& spec, const dist::ProcessGroupPtr& group);

// A module whose parameters are shards says how (the others are replicated).
class ShardedModule {
 public:
  virtual ~ShardedModule() = default;
  virtual ShardSpec shard_spec(const std::string& param) const = 0;
};

// Every parameter of `m` under its state-dict name, with its spec.
struct ShardedParameter {
  std::string name;
  Tensor tensor;
  ShardSpec spec;
};
std::vector<ShardedParameter> sharded_parameters(nn::Module& m);

// The state dict of the whole model at tp=1 (every shard gathered; names as
// state_dict()): collective over `group`, the same result on every rank.
NamedTensors full_state_dict(nn::Module& m, const dist::ProcessGroupPtr& group);
// Loads a tp=1 state dict (full tensors) into the shards of `m`: each rank
// copies its own slice. Strict as Module::load_state_dict (the error names a
// missing, unexpected or mis-shaped tensor). Not collective.
void load_full_state_dict(nn::Module& m, const NamedTensors& full, const dist::ProcessGroupPtr& group);

}  // namespace chorus::tp
