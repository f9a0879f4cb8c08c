// A training run's position counted in what it consumes -- examples for
// `chorus train`, tokens for a GPT -- rather than in optimizer steps.
//
// Note [Progress in samples]: a step consumes one global batch (examples or
// tokens over every device and rank), and the global batch changes when a run
// is resumed on another number of ranks or devices. So the position of record
// is the amount consumed, and the run's *reference step* is its first global
// batch (`per_step`, saved in every checkpoint and kept by every resume).
// Three things count in it:
//   - the step budget: --steps S means S reference steps, S x per_step
//     consumed, whatever the world size of the segments that consume them
//     (the last step may pass the budget by less than one global batch);
//   - the learning-rate schedule, which stays defined over reference steps
//     and is read at position consumed / per_step (between two of its steps,
//     linearly);
//   - checkpoint names (ckpt-<consumed / per_step>) and so the pruning of old
//     checkpoints and the fallback to the previous one, which follow the
//     position instead of the writer's own step count.
// llm.c and Megatron count tokens and samples the same way. A run whose global
// batch never changes sees exactly the steps, learning rates and checkpoint
// names it saw when progress was counted in steps.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

namespace chorus::app {

// The keys a checkpoint's extra fields use: "samples" and "step_samples"
// for chorus train, "tokens" and "step_tokens" for a GPT.
struct PositionKeys {
  const char* consumed;
  const char* per_step;
};
inline constexpr PositionKeys kSampleKeys{"samples", "step_samples"};
inline constexpr PositionKeys kTokenKeys{"tokens", "step_tokens"};

struct SavedPosition {
  int64_t consumed = 0;  // examples (tokens) consumed when the checkpoint was written
  int64_t per_step = 0;  // the run's reference step
};

// A checkpoint's position from its extra fields. A checkpoint written before
// they existed counts `step` steps of `writer_per_step` (its own global
// batch) and takes that as its reference step. IOError naming `state_path`
// when a field is there but not a positive (consumed: non-negative) integer.
SavedPosition read_position(const nlohmann::json& extra, PositionKeys keys, int64_t step, int64_t writer_per_step,
                            const std::string& state_path);

// The checkpoint step (and name) of a position: whole reference steps consumed.
inline int64_t reference_step(int64_t consumed, int64_t per_step) { return consumed / per_step; }

// Steps of `global_batch` still to run before `budget` is consumed (0 when it is).
int64_t steps_left(int64_t consumed, int64_t budget, int64_t global_batch);

// The learning rate at `consumed`, from a schedule over reference steps of
// `per_step`: lr_at_step(k) on a step boundary, linear between two.
double lr_at_position(const std::function<double(int64_t)>& lr_at_step, int64_t consumed, int64_t per_step);

}  // namespace chorus::app
