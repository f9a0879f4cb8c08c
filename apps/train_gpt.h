// `chorus train --model gpt2|...|dN`: the language-model driver. It shares
// the command line of `chorus train` (devices, strategy single|ddp, steps,
// batch size per device, lr, precision, seed, checkpoints, metrics, json) and
// adds the options of GptOptions. Data: llm.c token files (tokens:GLOB) or a
// text file's bytes (text:FILE, the last 10% held out for validation).
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace CLI {
class App;
}

#include "chorus/core/dtype.h"
#include "chorus/core/tensor.h"
#include "train.h"

namespace chorus::models {
class GPT;
class GPTPipelineLayers;
}
namespace chorus::parallel {
class Pipeline;
}
namespace chorus::nn {
class Module;
}
namespace chorus::dist {
class DistributedDataParallel;
class ShardedDataParallel;
}

namespace chorus::app {

struct GptOptions {
  int64_t seq_len = 0;                    // 0: 1024 for token files, 256 for text
  std::optional<std::string> val_data;    // tokens:GLOB | text:FILE (text:FILE: its last 10% by default)
  int64_t val_every = 0;                  // steps between validations (0: at the end only)
  int64_t val_windows = 32;               // evenly spaced windows of seq_len tokens
  int64_t grad_accum = 1;                 // micro-batches per optimizer step (no_sync under DDP)
  double clip = 1.0;                      // global gradient norm (0: no clipping)
  std::optional<int64_t> warmup_steps;    // unset: 5% of the steps, at least 1
  double min_lr_ratio = 0.1;              // the cosine ends at lr * this
  std::string windows = "sequential";     // sequential (epochs of disjoint windows) | random (any start)
  bool decay_embeddings = false;          // weight decay on wte/wpe too (torch_gpt.py and nanoGPT decay them)
  std::optional<std::string> init_from;   // a Hugging Face GPT-2 model.safetensors to start from
  std::optional<std::string> save_hf;     // write the trained weights in Hugging Face's layout here
  bool skip_nan = false;                  // a NaN loss skips its step instead of stopping the run
  double dropout = 0.0;
  std::string attention = "auto";         // auto | fused | composite (ops::AttentionKernel)
  bool recompute_gelu = false;            // --recompute-gelu (models::GPTConfig::recompute_gelu)
  // --mesh dp=A,pp=B,tp=C (apps/train_gpt_mesh.cpp): tensor parallelism,
  // pipeline stages over the pp groups (TrainConfig's --micro-batches,
  // --schedule, --balance), data parallelism over the dp groups; --sequence-parallel shards the
  // activations between the parallel regions along the sequence.
  std::optional<std::string> mesh;
  bool sequence_parallel = false;
  int tp_chunks = 1;  // --tp-chunks (tp::TPContext::chunks)
  bool allow_tp_across_nodes = false;
  // What the user gave explicitly among the shared options whose image
  // defaults do not suit a GPT (batch 64, SGD, weight decay 5e-4).
  bool batch_given = false, weight_decay_given = false, optimizer_given = false;
};

bool is_gpt_model(const std::string& model);
// Defines GptOptions' command-line options on `chorus train` (train_gpt_options.cpp).
void add_gpt_train_options(CLI::App* train, GptOptions& g);
// Throws ValueError naming the first bad option.
void validate_gpt(const TrainConfig& tc, const GptOptions& g);
nlohmann::ordered_json run_train_gpt(const TrainConfig& tc, const GptOptions& g);

// The --mesh driver (train_gpt_mesh.cpp): its option checks (ValueError naming
// the first bad one; run before any process group exists) and the run.
void validate_gpt_mesh(const TrainConfig& tc, const GptOptions& g);
nlohmann::ordered_json run_train_gpt_mesh(const TrainConfig& tc, const GptOptions& g);

// Shared by the drivers: whether --data is text:FILE; the training and
// validation specs of --data/--val-data (text:FILE: its first 90% and the
// rest); --seq-len or its default; Note [GPT schedule]'s learning rate of
// step i; a count as 1.2k / 3.45M.
bool text_spec(const std::string& spec);
std::string train_spec(const std::string& data);
std::string val_spec(const std::string& data, const std::optional<std::string>& val);
int64_t seq_len_of(const TrainConfig& tc, const GptOptions& g);
double lr_at(int64_t i, int64_t total, int64_t warmup, double lr, double min_ratio);
std::string fmt_count(double v);

// Forward and backward of one optimizer step's micro-batches (ids, targets on
// the model's device), under `autocast` when set; gradients accumulate, DDP
// or the sharded wrapper communicating on the last micro-batch only (no_sync
// before). Returns the step's mean loss, on the device (no host wait).
Tensor gpt_forward_backward(models::GPT& model, nn::Module& net, dist::DistributedDataParallel* ddp,
                            const std::vector<std::pair<Tensor, Tensor>>& micro, std::optional<DType> autocast,
                            dist::ShardedDataParallel* sdp = nullptr);

// The same for a GPT laid out as pipeline stages (Note [GPT as pipeline
// stages]): each micro-batch group through pipe.train_step, then the tied
// embedding's gradients merged. Returns the step's mean loss.
Tensor pipeline_forward_backward(models::GPT& model, parallel::Pipeline& pipe, models::GPTPipelineLayers& tied,
                                 const std::vector<std::pair<Tensor, Tensor>>& micro, std::optional<DType> autocast);

// The GPU's dense bf16 peak in FLOP/s, from its name (H100, H200, A100), or 0
// when unknown (then no MFU is reported).
double bf16_peak_flops(const std::string& device_name);

}  // namespace chorus::app
