// `chorus tokenize` and `chorus generate`: the language-model tools beside
// `chorus train --model gpt2...` (train_gpt.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace CLI {
class App;
}

namespace chorus::app {

struct TokenizeConfig {
  std::string input, output;
  std::optional<std::string> vocab, merges;  // GPT-2 BPE; neither: bytes
};

struct GenerateConfig {
  std::string checkpoint;  // a checkpoint directory, or the folder of a run's checkpoints (its newest)
  std::string prompt;
  int64_t max_tokens = 200;
  double temperature = 1.0;
  int64_t top_k = 0;  // 0: the whole vocabulary
  uint64_t seed = 0;
  std::string device;  // empty: cuda:0 where there is one, else cpu
  std::optional<std::string> vocab, merges;
};

CLI::App* add_tokenize_command(CLI::App& app, TokenizeConfig& c);
CLI::App* add_generate_command(CLI::App& app, GenerateConfig& c);
int run_tokenize(const TokenizeConfig& c);
int run_generate(const GenerateConfig& c);

}  // namespace chorus::app
