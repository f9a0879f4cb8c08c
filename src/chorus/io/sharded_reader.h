// Reading a sharded checkpoint (io/sharded_checkpoint.h) at any layout: any
// range of any tensor, assembled from whichever pieces overlap it, so that M
// ranks at any ZeRO stage, DDP, or one process load what N ranks wrote.
//
// Note [Shard file cache]: a shard file is read whole (load_safetensors,
// which validates all of it) the first time one of its pieces is needed and
// kept until clear_cache(): a rank loading its range of every tensor touches
// the same few files again and again. A rank of M reading what N wrote holds
// at most the files its ranges overlap; call clear_cache() between tensors
// when memory is short. Not thread-safe: one reader per thread.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "chorus/core/tensor.h"
#include "chorus/io/sharded_index.h"
#include "chorus/nn/module.h"

namespace chorus::io {

class ShardedCheckpoint {
 public:
  // `path`: a checkpoint directory (it holds index.json), or a directory of
  // checkpoints (its newest complete one, `latest` first). IOError naming the
  // path when it is neither, when the index is invalid (pieces that do not
  // tile a tensor: the tensor and the elements), or when a file the index
  // names is missing.
  static ShardedCheckpoint open(const std::string& path);

  const std::string& path() const { return path_; }  // the checkpoint directory
  const ShardedIndex& index() const { return index_; }
  int world() const { return index_.world; }
  const nlohmann::json& layout() const { return index_.layout; }
  const TrainingState& state() const { return index_.state; }
  // Every tensor's name, in the index's order (Note [Sharded checkpoint names]).
  std::vector<std::string> names() const;
  // ValueError naming the tensor when the checkpoint has none of that name.
  const ShardedTensorInfo& info(const std::string& name) const;

  // Elements [begin, end) of `name`'s row-major flattening: 1-d, on cpu:0, in
  // the tensor's dtype. ValueError for a range outside the tensor; IOError when
  // a file does not hold what the index says.
  Tensor read(const std::string& name, int64_t begin, int64_t end) const;
  // The whole tensor, in its shape.
  Tensor read_full(const std::string& name) const;
  // The updates range [begin, end) of optimizer buffer `name` received: the
  // pieces' common step (IOError when pieces that overlap it disagree, since
  // one range cannot have two counts; ValueError when `name` records none).
  int64_t read_step(const std::string& name, int64_t begin, int64_t end) const;

  void clear_cache() const { cache_.clear(); }

 private:
  ShardedCheckpoint(std::string path, ShardedIndex index) : path_(std::move(path)), index_(std::move(index)) {}
  const Tensor& piece_values(const ShardedTensorInfo& t, const PieceRef& p) const;

  std::string path_;
  ShardedIndex index_;
  mutable std::map<std::string, std::map<std::string, Tensor>> cache_;  // Note [Shard file cache]
};

// The whole model's state (state_dict names, shapes restored, buffers
// included), for Module::load_state_dict: what a one-process run or DDP
// loads.
nn::NamedTensors load_full_model_state(const ShardedCheckpoint& ckpt);
// The whole optimizer's state in Optimizer::state()'s names ("step", "lr",
// "param.<i>.step", "param.<i>.<buffer>" with i the parameter's position in
// the index's param_order), for Optimizer::load_state. ValueError when an
// optimizer buffer's parameter is not in param_order.
nn::NamedTensors load_full_optimizer_state(const ShardedCheckpoint& ckpt);

}  // namespace chorus::io
