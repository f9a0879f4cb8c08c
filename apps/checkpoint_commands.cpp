#include "checkpoint_commands.h"

#include <chrono>
#include <cstdio>
#include <map>

#include "chorus/core/error.h"
#include "chorus/io/safetensors.h"
#include "chorus/io/sharded_checkpoint.h"
#include "chorus/io/sharded_reader.h"
#include "chorus/models/gpt.h"
#include "cli_options.h"

namespace chorus::app {

CLI::App* add_checkpoint_command(CLI::App& app, CheckpointConfig& c) {
  CLI::App* cmd = app.add_subcommand("checkpoint", "Sharded checkpoints: consolidate into one file, or shard one file");
  cmd->require_subcommand(1);
  CLI::App* cons = cmd->add_subcommand(
      "consolidate", "Write a sharded checkpoint's full model into one safetensors file (a GPT's under Hugging Face's names)");
  cons->add_option("dir", c.dir, "A checkpoint directory, or a run's --checkpoint-dir (its newest)")->required();
  cons->add_option("out", c.out, "The .safetensors file to write")->required();
  cons->add_flag("--hf", c.hf, "Hugging Face names and layout (the default for a GPT; an error for other models)");
  cons->add_flag("--chorus-names", c.chorus_names, "A GPT's tensors under Chorus's names and layout instead");
  cons->parse_complete_callback([&c] { c.action = "consolidate"; });
  CLI::App* shard = cmd->add_subcommand("shard", "Split one full safetensors file into a sharded checkpoint of --world ranks");
  shard->add_option("in", c.in, "The full .safetensors file (Chorus's, or a Hugging Face GPT-2's)")->required();
  shard->add_option("dir", c.shard_dir, "The checkpoint directory to write ckpt-<step> into")->required();
  shard->add_option("--world", c.world, "Ranks: every tensor is split into this many even ranges")->required();
  shard->add_option("--step", c.step, "The step the checkpoint records")->capture_default_str();
  add_optional(shard, "--model", c.model, "A GPT's name (gpt2, d12, ...) when the file does not record one");
  shard->parse_complete_callback([&c] { c.action = "shard"; });
  return cmd;
}

namespace {

// One line on stderr at most every second while a long loop runs.
class Progress {
 public:
  Progress(const char* what, size_t total) : what_(what), total_(total) {}
  void tick(size_t done) {
    const auto now = std::chrono::steady_clock::now();
    if (now - last_ < std::chrono::seconds(1) && done != total_) return;
    last_ = now;
    std::fprintf(stderr, "%s: %zu/%zu tensors\n", what_, done, total_);
  }

 private:
  const char* what_;
  size_t total_;
  std::chrono::steady_clock::time_point last_ = std::chrono::steady_clock::now();
};

// The GPT a checkpoint's config names ("model", "vocab", "context", as
// chorus train --model gpt2... records them), if any.
std::optional<models::GPTConfig> gpt_of(const nlohmann::json& config) {
  if (!config.is_object() || !config.contains("model") || !config["model"].is_string()) return std::nullopt;
  const std::string name = config["model"].get<std::string>();
  if (!models::GPTConfig::is_gpt_name(name)) return std::nullopt;
  auto number = [&](const char* key, int64_t fallback) {
    return config.contains(key) && config[key].is_number_integer() ? config[key].get<int64_t>() : fallback;
  };
  return models::GPTConfig::named(name, number("vocab", 50257), number("context", 1024));
}

uint64_t bytes_of(const nn::NamedTensors& ts) {
  uint64_t n = 0;
  for (const auto& [name, t] : ts) n += t.nbytes();
  return n;
}

int run_consolidate(const CheckpointConfig& c) {
  CHORUS_CHECK(!(c.hf && c.chorus_names), "checkpoint consolidate: --hf and --chorus-names exclude each other");
  const io::ShardedCheckpoint ckpt = io::ShardedCheckpoint::open(c.dir);
  const nlohmann::json& config = ckpt.state().config;
  const std::optional<models::GPTConfig> gpt = gpt_of(config);
  CHORUS_CHECK(gpt || !c.hf, "checkpoint consolidate --hf: ", ckpt.path(),
               " is not a GPT's (its config names no GPT model), so it has no Hugging Face names");
  std::vector<std::string> names;
  for (const io::ShardedTensorInfo& t : ckpt.index().tensors)
    if (!t.optimizer) names.push_back(t.name);
  std::fprintf(stderr, "consolidate: %s (step %lld, %d shard%s, %zu model tensors)\n", ckpt.path().c_str(),
               (long long)ckpt.state().step, ckpt.world(), ckpt.world() == 1 ? "" : "s", names.size());
  nn::NamedTensors state;
  Progress progress("consolidate", names.size());
  for (const std::string& name : names) {
    state.emplace_back(name, ckpt.read_full(name));
    progress.tick(state.size());
  }
  ckpt.clear_cache();
  const bool to_hf = gpt && !c.chorus_names;
  if (to_hf) state = models::gpt_to_hf(state, *gpt);
  std::map<std::string, std::string> metadata{{"format", "pt"}, {"producer", "chorus"}};
  // What `chorus checkpoint shard` needs to turn the file back: the model and its layout.
  if (!config.empty()) metadata["chorus_config"] = config.dump();
  if (gpt) metadata["chorus_layout"] = to_hf ? "hf" : "chorus";
  io::save_safetensors(c.out, state, metadata);
  std::fprintf(stderr, "wrote %s: %zu tensors, %llu bytes of weights, %s\n", c.out.c_str(), state.size(),
               (unsigned long long)bytes_of(state),
               to_hf ? ("Hugging Face GPT-2 names and layout (" + config["model"].get<std::string>() + ")").c_str()
                     : "Chorus's names");
  return 0;
}

// Hugging Face's own GPT-2 files name the tensors without "transformer."
// (GPT2Model's names): the prefix Chorus's module tree has.
void add_transformer_prefix(nn::NamedTensors& ts) {
  bool bare = false;
  for (const auto& [name, t] : ts) bare |= name == "wte.weight";
  if (!bare) return;
  for (auto& [name, t] : ts)
    if (name != "lm_head.weight") name = "transformer." + name;
}

const Tensor* find_tensor(const nn::NamedTensors& ts, const std::string& name) {
  for (const auto& [n, t] : ts)
    if (n == name) return &t;
  return nullptr;
}

// A GPT-2 state in Hugging Face's layout (Conv1D weights [in, out]) turned
// into Chorus's; `config` gains the model, vocabulary and context it names.
void import_hf_gpt(nn::NamedTensors& ts, nlohmann::json& config, const std::optional<std::string>& model_opt) {
  const Tensor* wte = find_tensor(ts, "transformer.wte.weight");
  const Tensor* wpe = find_tensor(ts, "transformer.wpe.weight");
  const Tensor* attn = find_tensor(ts, "transformer.h.0.attn.c_attn.weight");
  if (!wte || !wpe || !attn || wte->dim() != 2 || wpe->dim() != 2) return;
  const int64_t width = wte->size(1);
  if (attn->sizes() != Shape{width, 3 * width}) return;  // Chorus's layout is [3 * width, width]
  int64_t layers = 0;
  while (find_tensor(ts, "transformer.h." + std::to_string(layers) + ".ln_1.weight")) ++layers;
  std::string name = model_opt ? *model_opt : (config.contains("model") && config["model"].is_string() ? config["model"].get<std::string>() : "");
  if (name.empty()) {
    // The heads, which no tensor shows, do not change any tensor's shape:
    // the first name of this depth and width converts the file.
    for (const std::string& n : models::GPTConfig::names()) {
      const models::GPTConfig g = models::GPTConfig::named(n);
      if (g.layers == layers && g.width == width) {
        name = n;
        break;
      }
    }
    CHORUS_CHECK(!name.empty(), "checkpoint shard: a GPT-2 of ", layers, " layers and width ", width,
                 " in Hugging Face's layout matches no known model; give --model");
  }
  const int64_t vocab = wte->size(0), context = wpe->size(0);
  ts = models::gpt_from_hf(ts, models::GPTConfig::named(name, vocab, context));
  config["model"] = name;
  config["vocab"] = vocab;
  config["context"] = context;
  std::fprintf(stderr, "shard: converted from Hugging Face's layout (GPT %s, vocabulary %lld, context %lld)\n",
               name.c_str(), (long long)vocab, (long long)context);
}

int run_shard(const CheckpointConfig& c) {
  CHORUS_CHECK(c.world >= 1 && c.world <= 100000, "checkpoint shard: --world must be between 1 and 100000, got ", c.world);
  CHORUS_CHECK(c.step >= 0, "checkpoint shard: --step must be >= 0, got ", c.step);
  CHORUS_CHECK(!c.model || models::GPTConfig::is_gpt_name(*c.model), "checkpoint shard: --model ", *c.model,
               " is not a GPT model's name");
  std::map<std::string, std::string> metadata;
  nn::NamedTensors ts = io::load_safetensors(c.in, &metadata);
  std::fprintf(stderr, "shard: %s (%zu tensors, %llu bytes)\n", c.in.c_str(), ts.size(),
               (unsigned long long)bytes_of(ts));
  nlohmann::json config = nlohmann::json::object();
  if (auto it = metadata.find("chorus_config"); it != metadata.end()) {
    try {
      config = nlohmann::json::parse(it->second);
    } catch (const nlohmann::json::exception& e) {
      CHORUS_THROW(IOError, c.in, ": metadata \"chorus_config\" is not valid JSON: ", e.what());
    }
  }
  if (c.model) config["model"] = *c.model;
  add_transformer_prefix(ts);
  import_hf_gpt(ts, config, c.model);
  // A GPT in Chorus's layout named by --model alone: the embedding's rows
  // (the padded vocabulary) and positions are what consolidate needs back.
  const Tensor* wte = find_tensor(ts, "transformer.wte.weight");
  const Tensor* wpe = find_tensor(ts, "transformer.wpe.weight");
  if (config.contains("model") && wte && wpe && wte->dim() == 2 && wpe->dim() == 2) {
    if (!config.contains("vocab")) config["vocab"] = wte->size(0);
    if (!config.contains("context")) config["context"] = wpe->size(0);
  }
  const int world = static_cast<int>(c.world);
  std::vector<io::ShardedSave> saves;
  for (int r = 0; r < world; ++r) {
    saves.push_back(io::shard_full_state(ts, {}, {}, r, world));
    saves.back().state.step = c.step;
    saves.back().state.config = config;
    saves.back().layout = {{"strategy", "shard"}, {"world", world}};
  }
  std::fprintf(stderr, "shard: writing %d shard%s\n", world, world == 1 ? "" : "s");
  const std::string path = io::save_sharded_checkpoint_from_one_process(c.shard_dir, saves, /*keep_last=*/0);
  std::fprintf(stderr, "wrote %s: %zu tensors in %d shard%s\n", path.c_str(), ts.size(), world, world == 1 ? "" : "s");
  return 0;
}

}  // namespace

int run_checkpoint(const CheckpointConfig& c) {
  if (c.action == "consolidate") return run_consolidate(c);
  if (c.action == "shard") return run_shard(c);
  CHORUS_THROW(ValueError, "checkpoint: give a subcommand, consolidate or shard");
}

}  // namespace chorus::app
