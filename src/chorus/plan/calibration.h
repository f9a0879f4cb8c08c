// What `chorus plan` measured on a device, kept in a JSON file so that a plan
// for 1024 GPUs can be made anywhere from one GPU's figures.
//
// Note [Calibration]: `chorus plan --calibrate FILE` times the real Chorus
// ops at each model's shapes (one micro-batch of `batch` x `seq` tokens, the
// run's precision, bf16 under autocast as training runs):
//   gemm        the four Linear layers of a block (c_attn, c_proj, c_fc,
//               mlp.c_proj), forward and backward: 72 N C^2 FLOPs; and
//               split 2, 4 and 8 ways (where the heads divide) at the
//               tensor-parallel shards' shapes: 72 N C^2 / tp
//   attention   ops::attention and its backward: llm.c's 6 N C T
//   classifier  the tied output projection and the fused cross entropy,
//               forward and backward: 6 N C Vp
//   other       a whole GPTBlock's forward and backward less the two above:
//               the norms, GELU, residual sums, bias gradients, per element
//               of N x C (0 when the block takes no longer than its parts)
//   optimizer   AdamW's step over a block's parameters with the gradient
//               clip folded in (optim::clip_and_step, as chorus train steps),
//               per parameter
//   recompute   a checkpointed block (nn::checkpoint) forward and backward,
//               eager: the block's forward runs twice as --recompute runs
//               it; the cost model's recompute ratio is its time over the
//               block's (version 2)
//   graph       on a GPU, the block, the classifier and the optimizer again,
//               each captured as a CUDA graph and replayed
//               (parallel::GraphedStep, as chorus train runs single, DDP and
//               ZeRO 1-2 steps): their times over the eager ones are the
//               cost model's graph ratios (version 2; absent where no graph
//               was captured: CPUs)
// Each class keeps its seconds, its work and the rate (work / seconds). The
// embeddings' lookups are not timed (small beside these). --model takes
// name[:batch] items (gpt2:16,gpt2-xl,gpt2-xl:2): one timing a model and
// micro-batch, so the plan finds the rates of the micro-batch it predicts
// (a pipeline's micro-batches are smaller than DDP's batch). Version 1
// files (no recompute, no graph) are read with a recompute ratio of 4/3 and
// graph ratios of 1, and the plan says so. Under `chorus launch` with 2+ ranks it also measures the
// all-reduce bus bandwidth (distributed/bus_bandwidth.h) at a few sizes and fits a
// latency and a bandwidth to them (fit_bus_bandwidth), and (version 2) how
// much slower the first model's MLP GEMMs run beside all-reduces of the
// largest size than alone: the cost model's overlap slowdown. The file names the
// device, the commit and the precision; a plan at another precision refuses
// it. Rates at one model's shapes serve others (the nearest width), and say
// so: a narrower GEMM (tensor parallel shards, small micro-batches) runs
// below the rate measured at full width.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "chorus/core/device.h"
#include "chorus/models/gpt.h"
#include "chorus/plan/cost_model.h"

namespace chorus::plan {

// One class's measurement: seconds per call, its work (FLOPs, elements or
// parameters) and work / seconds.
struct ClassTiming {
  double seconds = 0, work = 0, rate = 0;
};

// One model's shapes timed (Note [Calibration]).
struct ModelTiming {
  std::string model;
  int64_t width = 0, heads = 0, seq = 0, tokens = 0, padded_vocab = 0;
  ClassTiming gemm, attention, classifier, other, optimizer, block;
  // The four matrices split tp ways as tensor parallelism splits them
  // (c_attn and c_fc by output, c_proj and mlp.c_proj by input): (tp, timing).
  std::vector<std::pair<int64_t, ClassTiming>> gemm_shards;
  // Version 2: the checkpointed block (seconds 0 in a version 1 file) and the
  // CUDA graph replays (unset where none was captured).
  ClassTiming recompute;
  std::optional<ClassTiming> graph_block, graph_classifier, graph_optimizer;
  KernelRates rates() const;
};

// The all-reduce bus bandwidth over `ranks` ranks (nccl-tests' busbw).
struct BusBandwidth {
  int64_t ranks = 0;
  double busbw = 0;     // bytes a second
  double latency_s = 0;
  std::vector<std::pair<int64_t, double>> rows;  // (bytes, seconds per all-reduce)
  // A GEMM's time beside all-reduces over its time alone
  // (dist::slowdown_beside_all_reduce; version 2, 0: not measured).
  double overlap_slowdown = 0;
};

struct Calibration {
  int version = 2;  // the file's format version (1: before recompute and graph timings)
  std::string device, device_name, commit, precision;
  double peak_flops = 0;     // dense bf16 FLOPs a second (0: unknown)
  int64_t memory_bytes = 0;  // the device's memory (0: unknown)
  std::vector<ModelTiming> models;
  std::optional<BusBandwidth> bus;
};

// The rates to plan `cfg` at `seq` with: the timing of the same width and
// seq, else of the nearest width (then `exact` is false); of those, the one
// timed at the number of tokens nearest `tokens` (0: the first). ValueError
// when the calibration holds no timing.
const ModelTiming& timing_for(const Calibration& cal, const models::GPTConfig& cfg, int64_t seq, bool* exact,
                              int64_t tokens = 0);
// Rates for the cost model: `chosen`'s kernels, and in Rates::more the other
// timings of the same model's shapes (width, heads, seq) at other tokens.
Rates rates_for(const Calibration& cal, const ModelTiming& chosen);

// The file: write_calibration / read_calibration. read_calibration throws
// IOError for a file it cannot read and ValueError naming the file and the
// field for one that is not a calibration (not JSON, a field missing or not
// a positive number).
std::string calibration_json(const Calibration& cal);
Calibration parse_calibration(const std::string& text, const std::string& where);
void write_calibration(const std::string& path, const Calibration& cal);
Calibration read_calibration(const std::string& path);

// Times the classes of Note [Calibration] for `cfg` on `device` (one
// micro-batch of batch x seq tokens; bf16 under autocast), `iters` timed
// calls after `warmup`; the matrices' shards for each tp in `shards` that
// divides the heads.
ModelTiming time_gpt_kernels(const std::string& model, const models::GPTConfig& cfg, const Device& device,
                             int64_t batch, int64_t seq, bool bf16, int warmup, int iters,
                             const std::vector<int64_t>& shards = {2, 4, 8});

// A least-squares fit of t = latency + 2(n-1)/n bytes / busbw to measured
// all-reduces (the latency clamped at 0). ValueError for fewer than one row
// or ranks < 2.
BusBandwidth fit_bus_bandwidth(int64_t ranks, const std::vector<std::pair<int64_t, double>>& rows);

}  // namespace chorus::plan
