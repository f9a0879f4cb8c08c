// --strategy zero for `chorus train` (GPT and image models): the checks of
// its options, the ShardedDataParallel of a run's options (data_parallel/sharded.h)
// with its process groups for --hybrid, and the run's line.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "chorus/data_parallel/sharded.h"
#include "chorus/models/gpt.h"
#include "chorus/nn/module.h"
#include "train.h"
#include "train_dist.h"

namespace chorus::app {

// The options every zero run takes from its flags (`chorus train` and
// `chorus bench`): the stage, the bucket size, stage 3's resharding, the
// gathers ahead of use (--no-zero-prefetch: ShardOptions::prefetch) and the
// reduce dtype (--comm-hook bf16). ValueError for another comm hook.
dist::ShardOptions zero_flag_options(int stage, double bucket_mb, bool reshard_after_forward,
                                     const std::string& comm_hook, bool prefetch = true);

// What a GPT adds: the blocks named as units (stage 3: Note [Sharded units];
// stages 1-2: Note [Gathers beside the forward]);
// under --precision bf16 (unless param_dtype is "fp32") the blocks' matrices
// are gathered in bfloat16 (ShardOptions::param_dtype: the casts autocast
// would make at each use, made once per gather from the float32 masters),
// while embeddings, norms and biases stay float32, so everything else
// computes as under DDP. ValueError for a bad --zero-param-dtype.
void add_gpt_sharding(dist::ShardOptions& so, const models::GPT& model, bool bf16, const std::string& param_dtype);

// --zero-stage, --no-reshard-after-forward and --hybrid against --strategy:
// ValueError (one line) for a stage other than 1-3, for keeping weights below
// stage 3, and for any of them without --strategy zero.
void validate_zero_options(const TrainConfig& tc);

// zero_flag_options of the run's flags, for the trainer to add to (stage 3's
// units: Note [Sharded units], none given: found by ShardedDataParallel,
// its first step fully gathered; broadcast_buffers; add_gpt_sharding).
dist::ShardOptions zero_flag_options(const TrainConfig& tc);

// A collective over the job. --hybrid: the state is sharded over the ranks of
// one node (LOCAL_WORLD_SIZE of them) and replicated over the nodes;
// ValueError when the world is not whole nodes.
std::shared_ptr<dist::ShardedDataParallel> make_sharded(const TrainConfig& tc, const nn::ModulePtr& model,
                                                        const RankContext& ranks, dist::ShardOptions so);

// "zero-3 (8 units, reshard after forward) over 4 ranks": the run's line.
std::string describe_sharding(const dist::ShardedDataParallel& sdp, int world);

}  // namespace chorus::app
