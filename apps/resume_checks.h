// What `chorus train --resume` checks before it continues a checkpoint.
//
// Note [Resume checks]: a checkpoint continues the run that wrote it, so the
// settings that shape training (model, data, batch size, optimizer and its
// hyper-parameters, precision, seed, ...) must be the saved ones: the first
// field that differs is an error naming it, the saved and the given value.
// Changes that leave the saved state meaningful are allowed when asked for
// with --allow-change FIELD (kResumeChangeable: more epochs or steps, the
// data set moved to another directory, other devices); the learning-rate
// schedule then follows the new length. The saved position must lie within
// the run: an epoch, step or batch past its end, or a step that does not
// match the epoch and batch, is a damaged state.json, not a finished run.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "chorus/io/checkpoint.h"
#include "run_position.h"

namespace chorus::app {

inline const std::vector<std::string> kResumeChangeable = {"epochs", "steps", "data_dir", "devices", "strategy"};

// Settings that TrainConfig::to_json writes only when they are set, so that
// checkpoints from before they existed still compare: absent on either side
// means this value. The check runs both ways over them (a --sync-bn checkpoint
// resumed without --sync-bn is refused as much as the reverse).
inline const std::vector<std::pair<std::string, nlohmann::json>> kResumeDefaults = {{"sync_bn", false}};

// Throws ValueError naming `state_path` and the first field of `saved` that
// differs from `now` and is not in `allowed`.
void check_resume_config(const nlohmann::json& saved, const nlohmann::json& now,
                         const std::vector<std::string>& allowed, const std::string& state_path);

// Throws IOError naming `state_path` when the saved position is not one
// this run can reach (Note [Progress in samples]): past `epochs`, or past the
// budget of `steps` reference steps by a whole step of the writer's batch
// (`writer_batch` examples); a step other than the examples consumed in
// reference steps; and, where neither the writer nor this run changed the
// global batch (`global_batch` examples, `per_epoch` steps an epoch), a batch
// past the epoch or a step other than epoch * per_epoch + batch_in_epoch.
void check_resume_position(const io::TrainingState& st, const SavedPosition& at, int64_t writer_batch,
                           int64_t global_batch, int64_t per_epoch, int64_t epochs, std::optional<int64_t> steps,
                           const std::string& state_path);

}  // namespace chorus::app
