// --strategy zero for `chorus train` (GPT models): the ShardedDataParallel of
// a run's options (dist/sharded.h), with its process groups for --hybrid.
#pragma once

#include <memory>

#include "chorus/dist/sharded.h"
#include "chorus/models/gpt.h"
#include "train.h"
#include "train_dist.h"

namespace chorus::app {

// A collective over the job. --hybrid: the state is sharded over the ranks
// of one node (LOCAL_WORLD_SIZE of them) and replicated over the nodes;
// ValueError when the world is not whole nodes.
std::shared_ptr<dist::ShardedDataParallel> make_sharded(const TrainConfig& tc, const std::shared_ptr<models::GPT>& model,
                                                        const RankContext& ranks);

// "zero-3 (8 units, reshard after forward) over 4 ranks": the run's line.
std::string describe_sharding(const dist::ShardedDataParallel& sdp, int world);

}  // namespace chorus::app
