// Note [Mesh checkpoints]: a `chorus train --mesh` run writes its checkpoints
// in the one-process format (io/checkpoint.h: model.safetensors with
// models::GPT's names and full tensors, optimizer.safetensors with AdamW's
// state per parameter index, state.json), so `chorus train` without --mesh,
// `chorus generate`, and a --mesh run of any other tp resume from them. Saving
// gathers every shard (weights and AdamW moments) over the tensor-parallel
// group -- all ranks take part -- and the writer alone builds a full
// models::GPT and AdamW on the CPU to hand to io::save_checkpoint. Loading
// reads the checkpoint into such a pair on every rank and keeps its slices.
// The cost is one full model (and its moments) in host memory at save and
// load; the sharded format of the sharding issue (an index plus a file per
// rank) is what avoids it at scale.
#pragma once

#include <functional>
#include <string>

#include "chorus/distributed/process_group.h"
#include "chorus/io/checkpoint.h"
#include "chorus/optim/adamw.h"
#include "chorus/tensor_parallel/gpt.h"

namespace chorus::app {

// With pipeline stages (Note [GPT pipelines over the mesh]) a rank holds
// current values of its own stage's parameters only: each parameter (and its
// AdamW state) is gathered over the tensor group of the stage that holds it
// and broadcast from that stage over the pipeline group.
struct StageOwners {
  dist::ProcessGroupPtr pp_group;
  std::vector<int> owner;  // per parameter of tp::sharded_parameters: the pipeline rank holding it
};

// Collective over model.context().group (and stages->pp_group); returns the
// checkpoint's path on the writer, "" elsewhere (the caller's barrier makes it
// complete for everyone).
std::string save_mesh_checkpoint(const std::string& dir, tp::TensorParallelGPT& model, optim::AdamW& opt,
                                 const io::TrainingState& state, bool writer, const StageOwners* stages = nullptr);
// Not collective: each rank reads `ckpt` and keeps its slices.
io::TrainingState load_mesh_checkpoint(const std::string& ckpt, tp::TensorParallelGPT& model, optim::AdamW& opt,
                                       const std::function<void(const io::TrainingState&, const std::string&)>& check);

}  // namespace chorus::app
