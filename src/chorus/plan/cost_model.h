// The cost model behind `chorus plan`: a GPT's step time, tokens/s, MFU and
// memory per GPU under a layout (DDP, ZeRO stages, a dp x tp x pp mesh), on
// a number of GPUs this machine may not have, from kernel rates and bus
// bandwidths measured here (plan/calibration.h).
//
// Note [Cost model]: per micro-batch of N tokens (seq T, width C, padded
// vocabulary Vp, L blocks) on one GPU of a tensor group of tp:
//   block   = 72 N C^2 / (tp R_gemm(tp))    the four matrices, forward + backward
//                                           (R_gemm(tp): timed at the shards' shapes)
//           + 6 N C T  / (tp R_attention)   llm.c's causal attention count
//           + N C      / (tp R_other)       norms, GELU, residuals, biases
//                                           (sequence parallelism splits them too)
//   head    = 6 N C Vp / (tp R_classifier)  the tied classifier and its loss
//   recompute (--recompute, k of L blocks) runs their forward again: block x (1 + k/L (rho - 1)),
//                                           rho the checkpointed block's time over
//                                           the plain block's, both timed (a
//                                           version 1 calibration: 4/3)
// A step's compute adds AdamW over the parameters this GPU steps (R_optimizer
// parameters a second). Rates are measured at the model's shapes
// (Note [Calibration]); 72 N C^2 + 6 N C T per block plus 6 N C Vp is the
// FLOP count of GPTConfig::flops_per_token that MFU uses, less the norms'
// and the position embedding's parameters. The rates are those timed at the
// number of tokens nearest the micro-batch's (a pipeline's micro-batches are
// smaller than the batch, and a GEMM of fewer rows runs below the rate of
// more).
//
// Graphed steps: chorus train runs the whole step as one CUDA graph where it
// can (single, DDP, ZeRO 1-2: Note [Graphed step]); ZeRO-3 (which falls
// back to eager) and the meshes run eagerly. The rates above are eager
// launches; a graphed layout multiplies the block, the head and AdamW by the
// ratio of the same piece's time replayed as a CUDA graph to its eager time,
// each timed at the same shapes (1 where no graph was timed: CPUs, version 1
// files).
//
// Collectives over n ranks, g of them on each node, k = n / g nodes, a
// buffer of B bytes, busbw the all-reduce bus bandwidth (nccl-tests'
// definition) over NVLink, nic the bytes a second of one GPU's NIC, a the
// latency of one collective:
//   all-reduce      a + 2(n-1)/n B / busbw                       k = 1
//                   a + 2(g-1)/g B / busbw + 2(k-1)/k (B/g) / nic  k > 1 (hierarchical:
//                   reduce-scatter in the node, all-reduce of 1/g across, all-gather)
//   reduce-scatter, all-gather: half of the all-reduce's bandwidth terms
//   send/recv       a + B / busbw inside a node, a + B / nic across
// What hides what (and what hiding costs: compute running beside a
// collective is slowed by NCCL's kernels sharing the SMs, by a factor f
// measured by the calibration, so every overlap of length o below adds
// (f - 1) o to the step; f = 1 where not measured, or measured below 1):
//   DDP, ZeRO 1-2   the gradients' all-reduce (reduce-scatter) runs during the
//                   backward (2/3 of the compute): exposed = the last
//                   bucket's + max(0, the rest - backward); ZeRO 1-2 then
//                   all-gather the updated weights on the critical path.
//   ZeRO 3          every unit gathered for its forward and again for its
//                   backward, its gradients reduce-scattered, all prefetched:
//                   exposed = the first unit's gather + max(0, the other
//                   forward gathers (and the root's) - forward) + max(0, the
//                   backward's gathers and reduce-scatters - backward), the
//                   forward a third of the compute.
//   tensor          2 all-reduces over the tp group of the N C s bytes of
//                   activations per block forward and 2 backward, on the
//                   critical path
//                   (with sequence parallelism, which every tp > 1
//                   layout here uses: an all-gather and a reduce-scatter for
//                   each of them, the same bytes and twice the latencies),
//                   plus the
//                   vocabulary-parallel loss's two all-reduces of N floats.
//   pipeline        1F1B over p stages and m micro-batches, v chunks a device:
//                   step = (v m + p - 1) / v x slot, slot = the slowest
//                   pipeline rank's micro-batch, its v stages together, the
//                   stages split as chorus train splits them
//                   (parallel::balance_ranks, Note [Pipeline stages by cost] in
//                   models/gpt_pipeline.h): its blocks, on the last
//                   stage the head, and two memory-bound costs the
//                   calibrated pieces leave out, timed at AdamW's memory
//                   rate (28 bytes a parameter: float32 parameter, gradient
//                   and two moments read, three written): the in-place sum
//                   of each weight gradient into .grad by all but the
//                   first micro-batch ((m-1)/m x 12 bytes a parameter of
//                   the stage), and on the head's stage the logits written
//                   and the vocabulary-parallel loss's passes over them
//                   (4 s + 40 bytes a logit of N x Vp / tp; the calibrated
//                   classifier fuses its loss); + its tensor collectives +
//                   one activation sent and one gradient received (N C s /
//                   tp bytes), each a header then the tensor (2 latencies);
//                   bubble (p-1)/(v m + p - 1). The tensor-parallel mesh
//                   without stages (pp = 1) pays the loss's passes too. The
//                   data axis's all-reduce of a mesh with pp > 1 runs after
//                   the pipeline (as tp::average_gradients does), not
//                   hidden. Measured against this (4 x H200, gpt2-xl pp=4,
//                   16 micro-batches of 2, stages split 13, 13, 12, 12 as
//                   they then were): predicted / measured 1.18 (1F1B) and
//                   1.24 (interleaved), from 1.39 and 1.46 without these
//                   costs and with the heaviest stage taken as ceil(L/p)
//                   blocks and the head; what is still missing is not
//                   modelled (candidates: the host's issue gaps of eager
//                   2-sequence micro-batches, each received header having
//                   synchronised the host with its compute stream until
//                   Note [Received headers off the compute stream] in
//                   parallel/pipeline_messages.h; NCCL's kernels beside the
//                   compute).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "chorus/data_parallel/memory_plan.h"
#include "chorus/models/gpt.h"

namespace chorus::plan {

// The links between GPUs. Bandwidths in bytes a second.
struct Links {
  double nvlink_busbw = 0;  // all-reduce bus bandwidth inside a node
  double nic_bw = 0;        // one GPU's share of the network across nodes
  double latency_s = 0;     // a collective's fixed cost
  // Compute beside a collective runs this many times slower (NCCL's kernels
  // take SMs): 1 where not measured.
  double overlap_slowdown = 1;
  int64_t gpus_per_node = 8;
};

// A group of n ranks with `per_node` of them on each node (n / per_node nodes).
struct Group {
  int64_t n = 1, per_node = 1;
};

double all_reduce_seconds(double bytes, const Group& g, const Links& l);
double reduce_scatter_seconds(double bytes, const Group& g, const Links& l);  // bytes: the whole buffer
double all_gather_seconds(double bytes, const Group& g, const Links& l);      // bytes: the gathered buffer
double send_recv_seconds(double bytes, bool across_nodes, const Links& l);
// (p-1) / (v m + p - 1): the idle share of a 1F1B (v = 1) or interleaved pipeline.
double pipeline_bubble(int64_t stages, int64_t micro_batches, int64_t virtual_stages = 1);

// Kernel rates measured at one model's shapes (Note [Calibration]).
struct KernelRates {
  int64_t width = 0, heads = 0, seq = 0, tokens = 0;  // the shapes timed
  double gemm_flops = 0, attention_flops = 0, classifier_flops = 0;  // FLOPs a second
  double other_elements = 0;   // elements of N x C a block a second (0: none measured beyond the GEMMs)
  double optimizer_params = 0;  // AdamW: parameters a second
  // The block's matrices split tp ways (tensor parallel shards), where timed:
  // (tp, FLOPs a second).
  std::vector<std::pair<int64_t, double>> gemm_flops_shards;
  // A checkpointed block's time over the plain block's (Note [Cost model]).
  double recompute = 4.0 / 3.0;
  // A piece's time replayed as a CUDA graph over its eager time (1: not timed).
  double graph_block = 1, graph_classifier = 1, graph_optimizer = 1;
  // The rate of the matrices split tp ways: the shards' where timed, else gemm_flops.
  double gemm_rate(int64_t tp) const;
};

struct Rates {
  KernelRates kernels;
  // The same model's shapes timed at other micro-batch sizes (tokens).
  std::vector<KernelRates> more;
  // The rates timed at the number of tokens nearest `tokens` (in ratio;
  // kernels on a tie).
  const KernelRates& at(int64_t tokens) const;
  std::optional<Links> links;  // unset: no bus bandwidth known (no time for multi-GPU layouts)
  double peak_flops = 0;       // the device's dense bf16 peak (0: unknown, no MFU)
};

// A way to lay the job out. kind: "single", "ddp", "zero" (zero_stage 1-3)
// or "mesh" (dp x tp x pp, DDP over dp).
struct Layout {
  std::string kind = "ddp";
  int zero_stage = 0;
  int64_t dp = 1, tp = 1, pp = 1, micro_batches = 1, virtual_stages = 1;
  // "ddp", "zero-3", "dp=16,tp=4,pp=2 m=8 v=2"
  std::string name() const;
  // How to run it: "--strategy zero --zero-stage 3", "--mesh dp=16,tp=4,pp=2 --micro-batches 8 ..."
  std::string flags() const;
  int64_t gpus() const { return dp * tp * pp; }
};

// The job: the model, its micro-batch per GPU (`batch` sequences of `seq`
// tokens: a step moves batch x seq x gpus tokens under every layout), the
// precision and the machine.
struct Job {
  models::GPTConfig cfg;
  int64_t gpus = 1, gpus_per_node = 8;
  int64_t batch = 1, seq = 1024;
  bool bf16 = true;
  // ZeRO's gathered dtype for the blocks' matrices (--zero-param-dtype):
  // "" or "bf16" is bf16 under bf16, "fp32" float32.
  std::string zero_param_dtype;
  int64_t bucket_bytes = 25 << 20;
  int64_t gpu_memory_bytes = 0;  // what a GPU has for the plan's needed()
};

// ValueError naming what is wrong: gpus < 1, gpus_per_node < 1, more than one
// node and gpus not a multiple of gpus_per_node, batch or seq < 1, seq above
// the model's context.
void validate(const Job& job);

// The layouts worth trying over job.gpus: DDP (single on one GPU), ZeRO 1-3,
// and every dp x tp x pp with tp a power of two inside a node dividing the
// heads, the padded vocabulary and the GPUs, pp up to the layers, with
// m in {p, 2p, 4p, 8p} dividing the replica's batch (batch x tp x pp
// sequences) and v = 2 where m is a multiple of p and a stage has 2 blocks.
std::vector<Layout> layouts_worth_trying(const Job& job);

struct Prediction {
  Layout layout;
  dist::MemoryPlan memory;
  bool fits = false;
  // Unset when the rates are unknown (no calibration) or, with more than one
  // GPU, the links are.
  std::optional<double> step_s, compute_s, exposed_comm_s, bubble, tok_s, mfu;
};

// Memory alone (Note [Memory plan formulas], Note [Tensor and pipeline
// memory]): the DDP/ZeRO figures are the plan `chorus train` prints.
dist::MemoryPlan layout_memory(const Job& job, const Layout& layout);
// Whether chorus train runs the layout's step as one CUDA graph (single,
// DDP, ZeRO 1-2; Note [Cost model]).
bool step_is_graphed(const Layout& layout);
// One micro-batch's compute on one GPU (Note [Cost model]) of `layers`
// blocks, with the head when `head`; `graphed`: the block and the head
// scaled by their graph-over-eager ratios.
double micro_batch_compute_seconds(const Job& job, const KernelRates& k, int64_t tokens, int64_t tp, int64_t layers,
                                   bool head, bool graphed = false);
Prediction predict(const Job& job, const Layout& layout, const std::optional<Rates>& rates);
// Every layout worth trying, predicted; fitting layouts first, fastest first
// (by memory when there are no times).
std::vector<Prediction> plan_layouts(const Job& job, const std::optional<Rates>& rates);

}  // namespace chorus::plan
