// index.json of a sharded checkpoint (io/sharded_checkpoint.h): which file
// holds which range of which tensor, the layout that wrote it, and the
// training loop's position. docs/checkpoints.md shows one.
//
// Note [Sharded checkpoint names]: one namespace for every tensor of a
// checkpoint. Model tensors keep their state_dict names ("transformer.h.0.
// attn.c_attn.weight", buffers too). Optimizer state is "optimizer/<param>.
// <buffer>" ("optimizer/transformer.wte.weight.exp_avg") for a buffer over a
// parameter's elements, and "optimizer/<name>" for the optimizer's own
// replicated scalars ("optimizer/step", "optimizer/lr"). state_dict names never
// hold a '/', so the two halves cannot collide. A per-parameter step count is
// not a tensor: each piece of an optimizer buffer records in the index the
// updates its range has received ("step"), since ranks that own different
// ranges of one parameter keep their own counts.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "chorus/core/dtype.h"
#include "chorus/core/shape.h"
#include "chorus/io/checkpoint.h"

namespace chorus::io {

inline constexpr int kShardedCheckpointFormatVersion = 1;
inline constexpr const char* kShardedIndexFile = "index.json";
inline constexpr const char* kReplicatedFile = "replicated.safetensors";
inline constexpr const char* kOptimizerNamePrefix = "optimizer/";

// Elements [begin, end) of a tensor's row-major flattening, stored as the 1-d
// tensor `key` of `file` (a name inside the checkpoint directory).
struct PieceRef {
  std::string file, key;
  int64_t begin = 0, end = 0;
  std::optional<int64_t> step;  // optimizer buffers: updates this range has received
};

struct ShardedTensorInfo {
  std::string name;  // Note [Sharded checkpoint names]
  Shape shape;
  DType dtype = kFloat32;
  bool optimizer = false;     // part of the optimizer's state, not the model's
  std::string param, buffer;  // optimizer buffers over a parameter: "transformer.wte.weight", "exp_avg"
  std::vector<PieceRef> pieces;  // tile [0, numel) exactly (validated on read)
};

struct ShardedIndex {
  int world = 1;                                      // ranks that wrote it
  nlohmann::json layout = nlohmann::json::object();   // as the caller gave it: {"strategy": "zero", "stage": 2}
  std::string optimizer_name;                         // "AdamW"; empty: no optimizer state
  std::vector<std::string> param_order;               // parameter names in module->parameters() order
  TrainingState state;
  std::vector<ShardedTensorInfo> tensors;             // model tensors first, in the writer's order

  nlohmann::json to_json() const;
  // The tensor named `name`, or nullptr.
  const ShardedTensorInfo* find(const std::string& name) const;
};

// Parses and validates `text` (read from `path`, named in every error):
// fields and types, known dtypes, piece files that are plain names inside the
// directory, and that the pieces of every tensor tile [0, numel) with no gap
// or overlap. IOError naming the file, the tensor and the elements otherwise.
ShardedIndex parse_sharded_index(const std::string& text, const std::string& path);
// Reads `<ckpt_dir>/index.json` and parses it.
ShardedIndex read_sharded_index(const std::string& ckpt_dir);

// Throws IOError "<where>: tensor 'X': elements [a, b) ..." when `pieces` do
// not tile [0, numel) exactly (any order; empty pieces are allowed).
void check_pieces_tile(const std::string& where, const std::string& name, int64_t numel,
                       const std::vector<PieceRef>& pieces);

}  // namespace chorus::io
