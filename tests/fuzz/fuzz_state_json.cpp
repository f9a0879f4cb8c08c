// A checkpoint's state.json: the input is the file. A valid one must
// survive what resume does with it (copy, compare, dump).
#include "chorus/core/error.h"
#include "chorus/io/checkpoint.h"
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = chorus::fuzz::write_scratch("state.json", data, size);
  try {
    chorus::io::TrainingState s = chorus::io::read_training_state(path);
    nlohmann::json copy = s.config;
    if (copy != s.config) __builtin_trap();
    (void)s.extra.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  } catch (const chorus::Error&) {
  }
  return 0;
}
