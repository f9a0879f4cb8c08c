#include "resume_checks.h"

#include <algorithm>

#include "chorus/core/error.h"
#include "chorus/io/json_util.h"

namespace chorus::app {

void check_resume_config(const nlohmann::json& saved, const nlohmann::json& now,
                         const std::vector<std::string>& allowed, const std::string& state_path) {
  if (!saved.is_object())
    CHORUS_THROW(ValueError, state_path, ": the saved \"config\" is ", io::detail::json_excerpt(saved),
                 ", not the settings of a chorus train run; cannot check that --resume continues it");
  // The run's settings, and the ones written only when set that the
  // checkpoint has and this run leaves out (kResumeDefaults).
  std::vector<std::string> keys;
  for (const auto& item : now.items()) keys.push_back(item.key());
  for (const auto& d : kResumeDefaults)
    if (!now.contains(d.first) && saved.contains(d.first)) keys.push_back(d.first);
  for (const std::string& key : keys) {
    if (std::find(allowed.begin(), allowed.end(), key) != allowed.end()) continue;
    const nlohmann::json* fallback = nullptr;
    for (const auto& d : kResumeDefaults)
      if (d.first == key) fallback = &d.second;
    const nlohmann::json& value = now.contains(key) ? now.at(key) : *fallback;
    std::string option = "--" + key;
    std::replace(option.begin(), option.end(), '_', '-');
    if (!saved.contains(key) && !fallback)
      CHORUS_THROW(ValueError, state_path, ": the checkpoint's config has no \"", key,
                   "\", so --resume cannot check that ", option, " is the same (the checkpoint was written by another "
                   "version or edited)");
    const nlohmann::json& was = saved.contains(key) ? saved.at(key) : *fallback;
    if (was != value) {
      const bool changeable = std::find(kResumeChangeable.begin(), kResumeChangeable.end(), key) != kResumeChangeable.end();
      CHORUS_THROW(ValueError, "--resume: ", option, " is ", io::detail::json_excerpt(value), " but the checkpoint (",
                   state_path, ") was trained with ", io::detail::json_excerpt(was),
                   changeable ? "; pass --allow-change " + key + " to continue it with the new value"
                              : "; a checkpoint continues the run that wrote it (use another --checkpoint-dir for a new run)");
    }
  }
}

void check_resume_position(const io::TrainingState& st, const SavedPosition& at, int64_t writer_batch,
                           int64_t global_batch, int64_t per_epoch, int64_t epochs, std::optional<int64_t> steps,
                           const std::string& state_path) {
  const bool same_batch = writer_batch == global_batch && at.per_step == global_batch;
  if (same_batch && st.batch_in_epoch > per_epoch)
    CHORUS_THROW(IOError, state_path, ": batch_in_epoch ", st.batch_in_epoch, " is past the end of an epoch (",
                 per_epoch, " batches)");
  if (st.epoch > epochs || (st.epoch == epochs && st.batch_in_epoch > 0))
    CHORUS_THROW(IOError, state_path, ": epoch ", st.epoch, " (batch ", st.batch_in_epoch, ") is past the run's end (",
                 epochs, " epochs)");
  // The last step may pass the budget, by less than one of its batches.
  int64_t budget = 0;
  if (steps && !__builtin_mul_overflow(*steps, at.per_step, &budget) && at.consumed - writer_batch >= budget)
    CHORUS_THROW(IOError, state_path, ": step ", st.step, " (", at.consumed, " examples) is past the run's end (",
                 *steps, " steps of ", at.per_step, " examples)");
  if (st.step != reference_step(at.consumed, at.per_step))
    CHORUS_THROW(IOError, state_path, ": step ", st.step, " does not match the ", at.consumed, " examples consumed (",
                 at.per_step, " to a step: step ", reference_step(at.consumed, at.per_step), ")");
  // Overflow-free: epoch <= epochs and per_epoch * epochs was computed without overflow by the caller.
  if (same_batch && st.step != st.epoch * per_epoch + st.batch_in_epoch)
    CHORUS_THROW(IOError, state_path, ": step ", st.step, " does not match epoch ", st.epoch, " and batch ",
                 st.batch_in_epoch, " (", per_epoch, " batches per epoch: step ", st.epoch * per_epoch + st.batch_in_epoch,
                 ")");
}

}  // namespace chorus::app
