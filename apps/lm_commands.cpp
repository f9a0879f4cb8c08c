#include "lm_commands.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "chorus/autograd/grad_mode.h"
#include "chorus/core/device.h"
#include "chorus/core/error.h"
#include "chorus/data/bpe.h"
#include "chorus/io/checkpoint.h"
#include "chorus/io/safetensors.h"
#include "chorus/io/token_file.h"
#include "chorus/models/gpt.h"
#include "cli_numbers.h"
#include "cli_options.h"

namespace chorus::app {

namespace fs = std::filesystem;

CLI::App* add_tokenize_command(CLI::App& app, TokenizeConfig& c) {
  CLI::App* cmd = app.add_subcommand("tokenize", "Turn a text file into an llm.c token file (bytes, or GPT-2 BPE)");
  cmd->add_option("input", c.input, "Text file")->required();
  cmd->add_option("output", c.output, "Token file to write")->required();
  add_optional(cmd, "--vocab", c.vocab, "GPT-2 vocab.json (with --merges): BPE tokens instead of bytes");
  add_optional(cmd, "--merges", c.merges, "GPT-2 merges.txt (with --vocab)");
  return cmd;
}

CLI::App* add_generate_command(CLI::App& app, GenerateConfig& c) {
  CLI::App* cmd = app.add_subcommand("generate", "Sample text from a trained GPT checkpoint");
  cmd->add_option("--checkpoint", c.checkpoint, "A checkpoint directory, or a --checkpoint-dir (its newest)")->required();
  cmd->add_option("--prompt", c.prompt, "Text to continue")->capture_default_str();
  cmd->add_option("--max-tokens", c.max_tokens, "Tokens to sample")->capture_default_str()->transform(integer_up_to(1 << 20));
  cmd->add_option("--temperature", c.temperature, "Softmax temperature (0: the most likely token)")
      ->capture_default_str()->check(real_number(1e6, false, 0));
  cmd->add_option("--top-k", c.top_k, "Sample among the k most likely tokens (0: all)")->capture_default_str()
      ->transform(integer_up_to(1 << 20));
  cmd->add_option("--seed", c.seed, "Random seed")->capture_default_str()->transform(whole_number(0, UINT64_MAX));
  cmd->add_option("--device", c.device, "cpu | cuda:N (default: cuda:0 where there is one)");
  add_optional(cmd, "--vocab", c.vocab, "GPT-2 vocab.json for a model of GPT-2's vocabulary (with --merges)");
  add_optional(cmd, "--merges", c.merges, "GPT-2 merges.txt (with --vocab)");
  return cmd;
}

namespace {

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  CHORUS_CHECK_T(IOError, in.good(), "cannot read '", path, "'");
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

void check_bpe_pair(const std::optional<std::string>& vocab, const std::optional<std::string>& merges) {
  CHORUS_CHECK(vocab.has_value() == merges.has_value(), "--vocab and --merges go together (GPT-2's two BPE files)");
}

}  // namespace

int run_tokenize(const TokenizeConfig& c) {
  check_bpe_pair(c.vocab, c.merges);
  const std::string text = read_all(c.input);
  std::vector<int64_t> ids;
  if (c.vocab) {
    data::BpeTokenizer bpe(*c.vocab, *c.merges);
    ids = bpe.encode(text);
  } else {
    ids.reserve(text.size());
    for (unsigned char ch : text) ids.push_back(ch);
  }
  io::write_token_file(c.output, ids);
  std::fprintf(stderr, "%s: %zu bytes -> %zu tokens (%s) in %s\n", c.input.c_str(), text.size(), ids.size(),
               c.vocab ? "GPT-2 BPE" : "bytes", c.output.c_str());
  return 0;
}

int run_generate(const GenerateConfig& c) {
  check_bpe_pair(c.vocab, c.merges);
  std::string dir = c.checkpoint;
  if (!io::is_complete_checkpoint(dir)) {
    auto latest = io::find_latest_checkpoint(dir);
    CHORUS_CHECK_T(IOError, latest.has_value(), "'", dir, "' holds no checkpoint (expected a ckpt-* directory or a ",
                   "--checkpoint-dir with one)");
    dir = *latest;
  }
  const io::TrainingState st = io::read_training_state((fs::path(dir) / "state.json").string());
  CHORUS_CHECK(st.config.contains("model") && st.config.contains("vocab") && st.config.contains("context") &&
                   models::GPTConfig::is_gpt_name(st.config["model"].get<std::string>()),
               "checkpoint ", dir, " is not a GPT's (its config names no GPT model)");
  models::GPTConfig cfg = models::GPTConfig::named(st.config["model"].get<std::string>(),
                                                   st.config["vocab"].get<int64_t>(), st.config["context"].get<int64_t>());
  const Device device = c.device.empty() ? (cuda_is_available() ? cuda_device(0) : cpu_device(0)) : Device(c.device);
  models::GPT model(cfg);
  model.load_state_dict(io::load_safetensors((fs::path(dir) / "model.safetensors").string()));
  model.to(device);
  model.eval();

  std::unique_ptr<data::BpeTokenizer> bpe;
  if (c.vocab) bpe = std::make_unique<data::BpeTokenizer>(*c.vocab, *c.merges);
  CHORUS_CHECK(cfg.vocab == 256 || bpe, "this model's vocabulary has ", cfg.vocab,
               " tokens: give GPT-2's --vocab vocab.json and --merges merges.txt to read and write text");
  std::vector<int64_t> ids;
  if (bpe) {
    ids = bpe->encode(c.prompt);
  } else {
    for (unsigned char ch : c.prompt) ids.push_back(ch);
  }
  if (ids.empty()) ids.push_back(bpe ? 50256 : '\n');  // GPT-2's <|endoftext|>, or a new line
  for (int64_t id : ids)
    CHORUS_CHECK(id < cfg.vocab, "the prompt's token ", id, " is past the model's vocabulary of ", cfg.vocab);
  const size_t prompt_len = ids.size();

  std::mt19937_64 gen(c.seed);
  NoGradGuard no_grad;
  for (int64_t n = 0; n < c.max_tokens; ++n) {
    const int64_t t = std::min<int64_t>(static_cast<int64_t>(ids.size()), cfg.context);
    std::vector<int64_t> window(ids.end() - t, ids.end());
    Tensor x = from_vector(window, {1, t}, {kInt64}).to(device);
    Tensor logits = model.forward(x).select(1, t - 1).select(0, 0).narrow(0, 0, cfg.vocab);
    std::vector<float> v = logits.to(cpu_device(0), kFloat32).to_vector<float>();
    int64_t next = 0;
    if (c.temperature == 0) {
      next = std::max_element(v.begin(), v.end()) - v.begin();
    } else {
      std::vector<int64_t> order(v.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
      const size_t k = c.top_k > 0 ? std::min<size_t>(static_cast<size_t>(c.top_k), v.size()) : v.size();
      std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(),
                        [&](int64_t a, int64_t b) { return v[a] > v[b]; });
      std::vector<double> p(k);
      const double mx = v[order[0]];
      for (size_t i = 0; i < k; ++i) p[i] = std::exp((v[order[i]] - mx) / c.temperature);
      std::discrete_distribution<size_t> pick(p.begin(), p.end());
      next = order[pick(gen)];
    }
    ids.push_back(next);
  }
  std::string text;
  if (bpe) {
    text = bpe->decode(ids);
  } else {
    for (int64_t id : ids) text += static_cast<char>(id);
  }
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fputc('\n', stdout);
  std::fprintf(stderr, "generated %lld tokens after a prompt of %zu from %s\n", (long long)c.max_tokens, prompt_len,
               dir.c_str());
  return 0;
}

}  // namespace chorus::app
