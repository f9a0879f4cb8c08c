// Training checkpoints: model weights, optimizer state and the loop's position,
// written so that a crash at any moment leaves a loadable checkpoint behind.
//
// Layout under the checkpoint directory:
//   ckpt-00001200/model.safetensors      Module::state_dict(): readable by any
//                                        safetensors tool (PyTorch names)
//   ckpt-00001200/optimizer.safetensors  Optimizer::state()
//   ckpt-00001200/state.json             epoch, step, rng, config, format version
//   latest                               "ckpt-00001200\n"
//
// Design note [Checkpoint atomicity]: a checkpoint is written into a hidden
// ".tmp-ckpt-..." directory, every file fsync'ed, and the directory renamed
// into place; only then is `latest` replaced (temp file + rename) and are
// older checkpoints pruned. A reader therefore sees either the previous state
// or the new one. find_latest_checkpoint() trusts `latest` only when it names
// a complete checkpoint, and otherwise falls back to the highest-step complete
// one, so a crash between any two of these steps costs at most the checkpoint
// being written. One process (rank 0) writes to a directory at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "chorus/core/rng.h"
#include "chorus/nn/module.h"
#include "chorus/optim/optimizer.h"

namespace chorus::io {

// The training loop's position. `rng` is the generator state to restore on
// resume (default_generator().state() at save time); load_checkpoint returns
// it and leaves restoring it to the caller.
struct TrainingState {
  int64_t epoch = 0;
  int64_t step = 0;            // global optimizer steps done
  int64_t batch_in_epoch = 0;  // batches of `epoch` already consumed
  RngState rng;
  nlohmann::json config = nlohmann::json::object();  // the run's settings
  nlohmann::json extra = nlohmann::json::object();   // anything else the caller wants back
};

inline constexpr int kCheckpointFormatVersion = 1;

// Writes <dir>/ckpt-<step, 8 digits>/ atomically (see the note), points
// `latest` at it, then deletes all but the newest `keep_last` complete
// checkpoints (0 keeps all) and debris of crashed saves. Returns the new
// checkpoint's path. Saving a step that already exists replaces it.
std::string save_checkpoint(const std::string& dir, const nn::Module& module, const optim::Optimizer& optimizer,
                            const TrainingState& state, int keep_last = 3);

// The checkpoint to resume from, or nullopt when `dir` holds none.
std::optional<std::string> find_latest_checkpoint(const std::string& dir);

// A checkpoint resume_checkpoint could not read.
struct SkippedCheckpoint {
  std::string path;     // the checkpoint directory as found
  std::string reason;   // why it could not be read (the IOError's message)
  std::string kept_as;  // where it was moved; empty when it stayed in place
};

struct Resumed {
  std::optional<std::string> path;  // the checkpoint loaded; nullopt: none
  TrainingState state;              // its position (default when none)
  std::vector<SkippedCheckpoint> skipped;
};

// Design note [Unreadable checkpoints]: resume loads the newest checkpoint
// that can be read (`latest` first, then by step), skipping any whose files
// are missing, unreadable, not regular files, or corrupt (IOError), and says
// which it skipped and why. A skipped checkpoint is never deleted: once
// training goes on without it, it is renamed "<name>.unreadable" (so that
// neither pruning nor a later save of the same step removes it, and the user
// can inspect or repair it). When checkpoints exist but none can be read,
// this throws IOError naming each and why, touching nothing, unless
// `allow_fresh_start`; then it returns no path. A checkpoint that does not
// fit the module or optimizer (ValueError) is an error, never skipped.
// An empty or missing `dir` returns no path and skips nothing.
//
// `check`, when given, sees each candidate's state before its tensors are
// read (see load_checkpoint); what it throws propagates (an IOError from it
// too is fatal, not a reason to skip).
Resumed resume_checkpoint(const std::string& dir, nn::Module& module, optim::Optimizer& optimizer,
                          bool allow_fresh_start = false, const std::function<void(const TrainingState&, const std::string&)>& check = {});

// Loads a checkpoint directory into `module` and `optimizer`. Corrupted or
// truncated files throw IOError naming the file; a checkpoint that does not
// fit the model or optimizer throws ValueError naming the file and the keys.
// `check(state, state_json_path)`, when given, runs once state.json is read
// and before any tensor is: a caller's test that the checkpoint belongs to
// this run (its config), so that a mismatch is named as such rather than as
// a tensor that does not fit.
TrainingState load_checkpoint(const std::string& ckpt_dir, nn::Module& module, optim::Optimizer& optimizer,
                              const std::function<void(const TrainingState&, const std::string&)>& check = {});

// A checkpoint's state.json, validated (IOError naming the file otherwise).
TrainingState read_training_state(const std::string& path);

// "ckpt-00001200" for step 1200.
std::string checkpoint_name(int64_t step);
// True when `ckpt_dir` holds all three files.
bool is_complete_checkpoint(const std::string& ckpt_dir);

}  // namespace chorus::io
