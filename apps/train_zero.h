// --strategy zero for `chorus train` (GPT models): the ShardedDataParallel of
// a run's options (dist/sharded.h), with its process groups for --hybrid.
#pragma once

#include <memory>
#include <string>

#include "chorus/dist/sharded.h"
#include "chorus/models/gpt.h"
#include "train.h"
#include "train_dist.h"

namespace chorus::app {

// What a GPT run chose for sharding (`chorus train` and `chorus bench`).
struct GptShardChoice {
  int stage = 1;
  double bucket_mb = 25;
  bool reshard_after_forward = true;
  std::string comm_hook = "allreduce";  // allreduce | bf16
  bool bf16 = false;                    // --precision bf16
  std::string param_dtype;              // --zero-param-dtype: bf16 | fp32 | "" (bf16 under --precision bf16)
};
// The ShardOptions of a choice. Under --precision bf16 the blocks' matrices
// are gathered in bfloat16 (ShardOptions::param_dtype: the casts autocast
// would make at each use, made once per gather from the float32 masters);
// embeddings, norms and biases stay float32, so everything else computes as
// under DDP. Stage 3 names the blocks as units (Note [Sharded units]).
// ValueError for a bad comm hook or param dtype.
dist::ShardOptions gpt_shard_options(const GptShardChoice& c, const models::GPT& model);

// A collective over the job. --hybrid: the state is sharded over the ranks
// of one node (LOCAL_WORLD_SIZE of them) and replicated over the nodes;
// ValueError when the world is not whole nodes.
std::shared_ptr<dist::ShardedDataParallel> make_sharded(const TrainConfig& tc, const std::shared_ptr<models::GPT>& model,
                                                        const RankContext& ranks);

// "zero-3 (8 units, reshard after forward) over 4 ranks": the run's line.
std::string describe_sharding(const dist::ShardedDataParallel& sdp, int world);

}  // namespace chorus::app
