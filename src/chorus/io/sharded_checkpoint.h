// Sharded checkpoints: every rank writes the pieces of the parameters and
// optimizer state it owns (ZeRO 1/2/3, any contiguous range of each tensor's
// row-major elements), rank 0 writes one index, and any other layout -- M
// ranks at any stage, DDP, one process -- reads it back (io/sharded_reader.h).
// docs/checkpoints.md describes the format and the `chorus checkpoint`
// commands.
//
// Layout under the checkpoint directory (the one-process format's, Note
// [Checkpoint atomicity] in io/checkpoint.h, with other files inside):
//   ckpt-00001200/shard-00000-of-00003.safetensors  rank 0's pieces, 1-d
//   ckpt-00001200/shard-00001-of-00003.safetensors  ...
//   ckpt-00001200/replicated.safetensors             rank 0's whole tensors
//   ckpt-00001200/index.json                         written last
//   latest                                           "ckpt-00001200\n"
//
// Note [Sharded commit]: a checkpoint is complete when its directory holds a
// valid index.json, and the index is written only into a hidden temp
// directory whose every shard is already durable: rank 0 creates
// ".tmp-ckpt-<step>-<unique>" and publishes its name through the job's store;
// each rank writes its shard there (safetensors' writer fsyncs it and the
// directory) and then publishes its pieces' descriptions (or its failure)
// under its own key; rank 0 waits for all of them (at most `timeout`, then
// names the ranks that did not report), writes the index, renames the temp
// directory into place, replaces `latest`, prunes, and publishes the result,
// which the other ranks wait for, so that every rank's save returns (or
// fails) with the commit. A crash before the rename leaves only a hidden
// directory, which lookups never consider and the next commit deletes; after
// it, a complete checkpoint. The store's keys carry `key_prefix` and the step,
// so they must be unique per save within one job (ShardedCheckpointWriter
// numbers its saves).
//
// io/ reaches the job's processes only through io/commit_store.h's
// interface, which apps/ implements over the job's store.
#pragma once

#include <chrono>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "chorus/core/tensor.h"
#include "chorus/io/commit_store.h"
#include "chorus/io/checkpoint.h"
#include "chorus/nn/module.h"

namespace chorus::io {

// Elements [begin, end) of the row-major flattening of a tensor of `shape`
// and `dtype`: `values` is 1-d [end - begin], on any device, in `dtype`.
struct ShardPiece {
  std::string name;
  Shape shape;
  DType dtype = kFloat32;
  int64_t begin = 0, end = 0;
  Tensor values;
};

// One rank's optimizer state over elements [begin, end) of parameter
// `param` (of `shape`): buffers such as {"exp_avg", ...}, {"exp_avg_sq", ...},
// each 1-d [end - begin]; `step` is the updates this range has received.
// Stored as "optimizer/<param>.<buffer>" (Note [Sharded checkpoint names]).
struct OptimizerPiece {
  std::string param;
  Shape shape;
  int64_t begin = 0, end = 0;
  int64_t step = 0;
  std::vector<std::pair<std::string, Tensor>> buffers;
};

// What one rank saves. Every rank gives its own `model` and `optimizer`
// pieces (empty ranges are fine) and the same state.step (it names the
// checkpoint and the store's keys); the other fields are read from rank 0
// only, which writes the replicated tensors once.
struct ShardedSave {
  std::vector<ShardPiece> model;
  std::vector<OptimizerPiece> optimizer;
  nn::NamedTensors replicated_model;      // whole tensors every rank holds: buffers, replicated parameters
  nn::NamedTensors replicated_optimizer;  // the optimizer's own: "step", "lr" (stored as "optimizer/step", ...)
  std::vector<std::string> param_order;   // parameter names in module->parameters() order
  std::string optimizer_name;             // "AdamW"
  TrainingState state;                    // state.step names the checkpoint
  nlohmann::json layout = nlohmann::json::object();  // recorded as given: {"strategy": "zero", "stage": 2}
};

struct ShardedSaveOptions {
  int rank = 0, world = 1;
  CommitStorePtr store;                 // the job's store (adapted); may be null when world == 1
  std::string key_prefix = "chorus/sharded-ckpt";
  int keep_last = 3;                    // complete checkpoints kept (0: all)
  std::chrono::milliseconds timeout = std::chrono::minutes(10);  // for the other ranks' shards / rank 0's commit
};

// Writes this rank's shard and takes part in the commit (Note [Sharded
// commit]); returns the checkpoint's path once it is complete, on every rank.
// ValueError for bad pieces (a range outside the shape, values of the wrong
// size or dtype, a name twice), IOError for files and for another rank's
// failure, naming it; DistError when the store cannot be reached.
std::string save_sharded_checkpoint(const std::string& dir, const ShardedSave& save, const ShardedSaveOptions& options);

// All ranks' saves from one process (`saves[r]` is rank r's): the
// `chorus checkpoint shard` command, and tests. No store.
std::string save_sharded_checkpoint_from_one_process(const std::string& dir, const std::vector<ShardedSave>& saves,
                                                     int keep_last = 3);

// The checkpoint to load: the one `latest` names when complete, else the
// complete one of the highest step; nullopt when `dir` holds none.
std::optional<std::string> find_latest_sharded_checkpoint(const std::string& dir);
// True when `ckpt_dir` holds a valid index.json and every file it names.
bool is_complete_sharded_checkpoint(const std::string& ckpt_dir);

// "shard-00002-of-00008.safetensors".
std::string shard_file_name(int rank, int world);
// Rank `rank`'s range of `numel` elements split as evenly as possible over
// `world` ranks (the first numel % world ranks hold one more).
std::pair<int64_t, int64_t> even_range(int64_t numel, int rank, int world);

// Rank `rank`'s save of a full model state (and, when given, a full
// optimizer state in Optimizer::state()'s names, "param.<i>.<buffer>" with i
// the position in `param_order`): every model tensor and optimizer buffer
// split by even_range (a buffer of the model too: the reader puts it back
// together), the optimizer's scalars ("step", "lr") replicated. The pieces
// are views of the given tensors, not copies.
ShardedSave shard_full_state(const nn::NamedTensors& model_state, const nn::NamedTensors& optimizer_state,
                             const std::vector<std::string>& param_order, int rank, int world);

}  // namespace chorus::io
