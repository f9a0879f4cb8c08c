// --strategy zero for `chorus train` (GPT and image models): the checks of
// its options, the ShardedDataParallel of a run's options (dist/sharded.h)
// with its process groups for --hybrid, and the run's line.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "chorus/dist/sharded.h"
#include "chorus/models/gpt.h"
#include "chorus/nn/module.h"
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

// --zero-stage, --no-reshard-after-forward and --hybrid against --strategy:
// ValueError (one line) for a stage other than 1-3, for keeping weights below
// stage 3, and for any of them without --strategy zero.
void validate_zero_options(const TrainConfig& tc);

// A collective over the job. `so` carries what the trainer decides (stage
// 3's units: Note [Sharded units], none given: found by ShardedDataParallel,
// its first step fully gathered; broadcast_buffers); the options set the
// rest (stage, buckets, resharding, the reduce dtype). --hybrid: the state is
// sharded over the ranks of one node (LOCAL_WORLD_SIZE of them) and
// replicated over the nodes; ValueError when the world is not whole nodes.
std::shared_ptr<dist::ShardedDataParallel> make_sharded(const TrainConfig& tc, const nn::ModulePtr& model,
                                                        const RankContext& ranks, dist::ShardOptions so = {});

// "zero-3 (8 units, reshard after forward) over 4 ranks": the run's line.
std::string describe_sharding(const dist::ShardedDataParallel& sdp, int world);

}  // namespace chorus::app
