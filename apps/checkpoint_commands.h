// `chorus checkpoint consolidate|shard`: a sharded checkpoint
// (io/sharded_checkpoint.h) into one full safetensors file, and back.
// docs/checkpoints.md shows both.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace CLI {
class App;
}

namespace chorus::app {

struct CheckpointConfig {
  std::string action;  // "consolidate" or "shard": the subcommand given
  // consolidate DIR OUT
  std::string dir, out;
  bool hf = false;            // insist on Hugging Face names (an error for a model that is not a GPT)
  bool chorus_names = false;  // a GPT's tensors under Chorus's names and layout instead
  // shard IN DIR --world N
  std::string in, shard_dir;
  int64_t world = 0;
  int64_t step = 0;
  std::optional<std::string> model;  // a GPT's name when the file does not say (Hugging Face files)
};

// Adds `checkpoint` with its two subcommands; run_checkpoint runs whichever was given.
CLI::App* add_checkpoint_command(CLI::App& app, CheckpointConfig& c);
int run_checkpoint(const CheckpointConfig& c);

}  // namespace chorus::app
