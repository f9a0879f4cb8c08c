// The steps of writing a sharded checkpoint, shared by the store-driven
// multi-rank save (sharded_store_commit.cpp) and the one-process save of all
// ranks (sharded_checkpoint.cpp). Note [Sharded commit] in
// io/sharded_checkpoint.h puts them in order.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "chorus/io/sharded_checkpoint.h"
#include "chorus/io/sharded_index.h"

namespace chorus::io::detail {

// Creates "<dir>/.tmp-<ckpt name>-<unique>" (and `dir`); returns its path.
std::string make_sharded_tmp_dir(const std::string& dir, int64_t step);

// Checks `save`'s pieces (ValueError naming the rank and the piece), writes
// them to <tmp_dir>/shard-<rank>-of-<world>.safetensors and returns their
// description for the index: {"file": ..., "tensors": [{"name", "kind",
// "shape", "dtype", "begin", "end", "param"?, "buffer"?, "step"?}]}.
nlohmann::json write_rank_shard(const std::string& tmp_dir, int rank, int world, const ShardedSave& save);

// Rank 0's replicated tensors into <tmp_dir>/replicated.safetensors.
void write_replicated(const std::string& tmp_dir, const ShardedSave& rank0);

// The index of the ranks' descriptions (ranks[r] from write_rank_shard) and
// rank 0's replicated tensors and metadata. ValueError when ranks disagree on
// a tensor's shape, dtype or kind, or when the pieces do not tile a tensor.
ShardedIndex build_sharded_index(const std::vector<nlohmann::json>& ranks, const ShardedSave& rank0, int world);

// Writes index.json into `tmp_dir`, renames it to <dir>/ckpt-<step>, replaces
// `latest` and prunes to `keep_last`. Removes `tmp_dir` on failure (IOError
// saying the checkpoints before it are intact). Returns the checkpoint's path.
std::string commit_sharded_checkpoint(const std::string& dir, const std::string& tmp_dir, const ShardedIndex& index,
                                      int keep_last);

}  // namespace chorus::io::detail
