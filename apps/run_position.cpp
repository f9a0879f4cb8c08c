#include "run_position.h"

#include "chorus/core/error.h"
#include "chorus/io/json_util.h"

namespace chorus::app {

namespace {

int64_t read_count(const nlohmann::json& extra, const char* key, int64_t fallback, int64_t minimum,
                   const std::string& state_path) {
  auto it = extra.find(key);
  if (it == extra.end()) return fallback;
  if (!it->is_number_integer() || it->get<int64_t>() < minimum)
    CHORUS_THROW(IOError, state_path, ": \"", key, "\" is ", io::detail::json_excerpt(*it), ", not an integer >= ",
                 minimum);
  return it->get<int64_t>();
}

}  // namespace

SavedPosition read_position(const nlohmann::json& extra, PositionKeys keys, int64_t step, int64_t writer_per_step,
                            const std::string& state_path) {
  SavedPosition p;
  p.per_step = read_count(extra, keys.per_step, writer_per_step, 1, state_path);
  int64_t old = 0;  // before the fields: step steps of the writer's global batch
  if (!extra.contains(keys.consumed) && __builtin_mul_overflow(step, writer_per_step, &old))
    CHORUS_THROW(IOError, state_path, ": step ", step, " of ", writer_per_step, " is more than can be counted");
  p.consumed = read_count(extra, keys.consumed, old, 0, state_path);
  return p;
}

int64_t steps_left(int64_t consumed, int64_t budget, int64_t global_batch) {
  if (consumed >= budget) return 0;
  const int64_t rest = budget - consumed;
  return rest / global_batch + (rest % global_batch != 0);
}

double lr_at_position(const std::function<double(int64_t)>& lr_at_step, int64_t consumed, int64_t per_step) {
  const int64_t k = consumed / per_step, part = consumed % per_step;
  const double at = lr_at_step(k);
  if (part == 0) return at;
  const double f = static_cast<double>(part) / static_cast<double>(per_step);
  return at + (lr_at_step(k + 1) - at) * f;
}

}  // namespace chorus::app
