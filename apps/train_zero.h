// --strategy zero for `chorus train` (GPT and image models): the checks of
// its options, the ShardedDataParallel of a run's options (dist/sharded.h)
// with its process groups for --hybrid, and the run's line.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "chorus/dist/sharded.h"
#include "chorus/nn/module.h"
#include "train.h"
#include "train_dist.h"

namespace chorus::app {

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
