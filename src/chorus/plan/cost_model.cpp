#include "chorus/plan/cost_model.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "chorus/core/error.h"
#include "chorus/models/gpt_memory.h"
#include "chorus/plan/gpt_layout_memory.h"
#include "chorus/models/gpt_pipeline.h"
#include "chorus/parallel/placement.h"

namespace chorus::plan {

namespace {

// Note [Cost model]'s hierarchical collective: `factor` is 2 for an
// all-reduce and 1 for a reduce-scatter or an all-gather.
double collective_seconds(double factor, double bytes, const Group& g, const Links& l) {
  CHORUS_CHECK(g.n >= 1 && g.per_node >= 1 && g.n % g.per_node == 0, "a group of ", g.n, " ranks cannot have ",
               g.per_node, " on each node");
  if (g.n == 1) return 0.0;
  const double n = static_cast<double>(g.n), per = static_cast<double>(g.per_node);
  const double nodes = n / per;
  CHORUS_CHECK(l.nvlink_busbw > 0 && (nodes == 1 || l.nic_bw > 0), "the links' bandwidths must be positive");
  if (nodes == 1) return l.latency_s + factor * (n - 1) / n * bytes / l.nvlink_busbw;
  return l.latency_s + factor * (per - 1) / per * bytes / l.nvlink_busbw +
         factor * (nodes - 1) / nodes * (bytes / per) / l.nic_bw;
}

// The group of the data axis: ranks `stride` apart (tp x pp), so a node holds
// gpus_per_node / stride of them (at least one).
Group data_group(const Job& job, int64_t n, int64_t stride) {
  const int64_t per = std::clamp<int64_t>(job.gpus_per_node / stride, 1, n);
  return {n, n % per == 0 ? per : 1};
}

}  // namespace

double all_reduce_seconds(double bytes, const Group& g, const Links& l) { return collective_seconds(2, bytes, g, l); }
double reduce_scatter_seconds(double bytes, const Group& g, const Links& l) {
  return collective_seconds(1, bytes, g, l);
}
double all_gather_seconds(double bytes, const Group& g, const Links& l) { return collective_seconds(1, bytes, g, l); }

double send_recv_seconds(double bytes, bool across_nodes, const Links& l) {
  const double bw = across_nodes ? l.nic_bw : l.nvlink_busbw;
  CHORUS_CHECK(bw > 0, "the links' bandwidths must be positive");
  return l.latency_s + bytes / bw;
}

double pipeline_bubble(int64_t stages, int64_t micro_batches, int64_t virtual_stages) {
  CHORUS_CHECK(stages >= 1 && micro_batches >= 1 && virtual_stages >= 1,
               "a pipeline needs at least one stage, micro-batch and chunk");
  return static_cast<double>(stages - 1) / static_cast<double>(virtual_stages * micro_batches + stages - 1);
}

std::string Layout::name() const {
  if (kind == "zero") return "zero-" + std::to_string(zero_stage);
  if (kind != "mesh") return kind;
  std::string s = "dp=" + std::to_string(dp) + ",tp=" + std::to_string(tp) + ",pp=" + std::to_string(pp);
  if (pp > 1) s += " m=" + std::to_string(micro_batches);
  if (virtual_stages > 1) s += " v=" + std::to_string(virtual_stages);
  return s;
}

std::string Layout::flags() const {
  if (kind == "single") return "--strategy single";
  if (kind == "ddp") return "--strategy ddp";
  if (kind == "zero") return "--strategy zero --zero-stage " + std::to_string(zero_stage);
  std::string s = "--mesh dp=" + std::to_string(dp) + ",tp=" + std::to_string(tp) + ",pp=" + std::to_string(pp);
  if (tp > 1) s += " --sequence-parallel";
  if (pp > 1) s += " --micro-batches " + std::to_string(micro_batches);
  if (virtual_stages > 1) s += " --schedule interleaved --virtual-stages " + std::to_string(virtual_stages);
  return s;
}

void validate(const Job& job) {
  CHORUS_CHECK(job.zero_param_dtype.empty() || job.zero_param_dtype == "bf16" || job.zero_param_dtype == "fp32",
               "--zero-param-dtype must be bf16 or fp32, got '", job.zero_param_dtype, "'");
  CHORUS_CHECK(job.gpus >= 1, "--gpus must be at least 1, got ", job.gpus);
  CHORUS_CHECK(job.gpus_per_node >= 1, "--gpus-per-node must be at least 1, got ", job.gpus_per_node);
  CHORUS_CHECK(job.gpus <= job.gpus_per_node || job.gpus % job.gpus_per_node == 0, "--gpus ", job.gpus,
               " spans more than one node but is not a multiple of --gpus-per-node ", job.gpus_per_node);
  CHORUS_CHECK(job.batch >= 1 && job.seq >= 1, "--batch-size and --seq-len must be at least 1");
  CHORUS_CHECK(job.seq <= job.cfg.context, "--seq-len ", job.seq, " exceeds the model's context of ",
               job.cfg.context);
}

std::vector<Layout> layouts_worth_trying(const Job& job) {
  validate(job);
  std::vector<Layout> out;
  if (job.gpus == 1) {
    out.push_back({"single"});
  } else {
    out.push_back({"ddp", 0, job.gpus});
    for (int stage = 1; stage <= 3; ++stage) out.push_back({"zero", stage, job.gpus});
  }
  const int64_t node = std::min(job.gpus, job.gpus_per_node);
  for (int64_t tp = 1; tp <= node; tp *= 2) {
    if (job.gpus % tp != 0 || job.cfg.heads % tp != 0 || job.cfg.padded_vocab % tp != 0) continue;
    for (int64_t pp = 1; pp <= std::min(job.gpus / tp, job.cfg.layers); ++pp) {
      if ((job.gpus / tp) % pp != 0 || (tp == 1 && pp == 1)) continue;
      const int64_t dp = job.gpus / (tp * pp);
      const int64_t replica_batch = job.batch * tp * pp;  // sequences a step, as batch x gpus over dp replicas
      if (pp == 1) {
        out.push_back({"mesh", 0, dp, tp, 1, 1, 1});
        continue;
      }
      for (int64_t m = pp; m <= 8 * pp; m *= 2) {
        if (replica_batch % m != 0) continue;
        out.push_back({"mesh", 0, dp, tp, pp, m, 1});
        if (m % pp == 0 && job.cfg.layers >= 2 * pp) out.push_back({"mesh", 0, dp, tp, pp, m, 2});
      }
    }
  }
  return out;
}

dist::MemoryPlan layout_memory(const Job& job, const Layout& layout) {
  GptMemoryRun run;
  run.bf16 = job.bf16;
  run.seq = job.seq;
  run.bucket_bytes = job.bucket_bytes;
  run.zero_param_dtype = job.zero_param_dtype;
  run.fused_attention = gpt_fused_attention_on_gpu(job.cfg, job.bf16);
  if (layout.kind == "mesh") {
    run.batch = job.batch * layout.tp * layout.pp / layout.micro_batches;
    return mesh_memory_plan(job.cfg, run, layout.dp, layout.tp, layout.pp, layout.micro_batches,
                            layout.virtual_stages);
  }
  run.batch = job.batch;
  dist::MemoryStrategy s;
  s.name = layout.kind;
  s.world = layout.kind == "single" ? 1 : layout.dp;
  s.zero_stage = layout.zero_stage;
  return dist::plan_for(s, gpt_memory_inputs(job.cfg, run));
}

double KernelRates::gemm_rate(int64_t tp) const {
  for (const auto& [t, r] : gemm_flops_shards)
    if (t == tp && r > 0) return r;
  return gemm_flops;
}

const KernelRates& Rates::at(int64_t tokens) const {
  const KernelRates* best = &kernels;
  auto distance = [tokens](const KernelRates& k) {
    return k.tokens > 0 && tokens > 0 ? std::abs(std::log(static_cast<double>(k.tokens) / static_cast<double>(tokens)))
                                      : 0.0;
  };
  for (const KernelRates& k : more)
    if (distance(k) < distance(*best)) best = &k;
  return *best;
}

bool step_is_graphed(const Layout& layout) {
  return layout.kind == "single" || layout.kind == "ddp" || (layout.kind == "zero" && layout.zero_stage <= 2);
}

double micro_batch_compute_seconds(const Job& job, const KernelRates& k, int64_t tokens, int64_t tp, int64_t layers,
                                   bool head, bool graphed) {
  CHORUS_CHECK(k.gemm_flops > 0 && k.attention_flops > 0 && k.classifier_flops > 0,
               "the kernel rates must be positive");
  const double n = static_cast<double>(tokens), c = static_cast<double>(job.cfg.width);
  const double t = static_cast<double>(job.seq), vp = static_cast<double>(job.cfg.padded_vocab);
  const double split = static_cast<double>(tp);
  double block = 72 * n * c * c / (split * k.gemm_rate(tp)) + 6 * n * c * t / (split * k.attention_flops) +
                 (k.other_elements > 0 ? n * c / (split * k.other_elements) : 0.0);
  CHORUS_CHECK(k.recompute > 0 && k.graph_block > 0 && k.graph_classifier > 0,
               "the recompute and graph ratios must be positive");
  // A recomputed block runs its forward again: rho, the checkpointed
  // block's time over the plain one's, for the k of the L blocks that
  // recompute (Note [Recomputing some blocks] in models/gpt.cpp).
  const double recomputed = static_cast<double>(job.cfg.recomputed_blocks()) / static_cast<double>(job.cfg.layers);
  block *= 1.0 + recomputed * (k.recompute - 1.0);
  double head_s = head ? 6 * n * c * vp / (split * k.classifier_flops) : 0.0;
  if (graphed) block *= k.graph_block, head_s *= k.graph_classifier;
  return static_cast<double>(layers) * block + head_s;
}

namespace {

// The parameters' bytes ZeRO gathers: the blocks' matrices in 16 bits under
// bf16 (--zero-param-dtype's default; fp32 gathers them in float32), the rest
// in float32.
double gathered_weight_bytes(const Job& job, int64_t params, int64_t matrices) {
  return job.bf16 && job.zero_param_dtype != "fp32" ? 2.0 * static_cast<double>(matrices) + 4.0 * static_cast<double>(params - matrices)
                  : 4.0 * static_cast<double>(params);
}

// What compute running beside collectives for `overlap_s` loses to them:
// (slowdown - 1) x the overlap (Note [Cost model]); a measured slowdown
// below 1 is timing noise, not compute sped up by a collective: none.
double contention(double overlap_s, const Links& l) {
  return std::max(0.0, l.overlap_slowdown - 1.0) * std::max(0.0, overlap_s);
}

// The exposed part of a gradient reduction overlapped with the backward
// (Note [Cost model]): the last bucket's, what the rest needs beyond the
// backward's time, and the backward slowed while the rest runs beside it.
double overlapped_reduction(double total_s, double last_bucket_s, double backward_s, const Links& l) {
  const double rest = std::max(0.0, total_s - last_bucket_s);
  return std::min(total_s, last_bucket_s + std::max(0.0, rest - backward_s)) +
         contention(std::min(rest, backward_s), l);
}

}  // namespace

Prediction predict(const Job& job, const Layout& layout, const std::optional<Rates>& rates) {
  Prediction p;
  p.layout = layout;
  p.memory = layout_memory(job, layout);
  p.fits = job.gpu_memory_bytes <= 0 || p.memory.fits(job.gpu_memory_bytes);
  if (!rates || (layout.gpus() > 1 && !rates->links)) return p;
  const Links links = rates->links.value_or(Links{});
  const models::GPTConfig& cfg = job.cfg;
  const double P = static_cast<double>(cfg.num_parameters());
  const double s = job.bf16 ? 2.0 : 4.0;
  const double matrices = static_cast<double>(12 * cfg.width * cfg.width * cfg.layers);
  const double tokens_per_step = static_cast<double>(job.batch * job.seq * job.gpus);
  double compute = 0, exposed = 0, bubble = 0, step = 0;
  const bool graphed = step_is_graphed(layout);

  if (layout.kind != "mesh") {
    const int64_t n = layout.kind == "single" ? 1 : layout.dp;
    const Group g = data_group(job, n, 1);
    const KernelRates& k = rates->at(job.batch * job.seq);
    const double adamw = (graphed ? k.graph_optimizer : 1.0) / k.optimizer_params;
    const double fwd_bwd = micro_batch_compute_seconds(job, k, job.batch * job.seq, 1, cfg.layers, true, graphed);
    const double backward = fwd_bwd * 2.0 / 3.0;
    const double stepped = layout.kind == "zero" ? P / static_cast<double>(n) : P;
    compute = fwd_bwd + stepped * adamw;
    const double grads = 4.0 * P, bucket = std::min(grads, static_cast<double>(job.bucket_bytes));
    if (n > 1 && layout.kind == "ddp") {
      exposed = overlapped_reduction(all_reduce_seconds(grads, g, links) +
                                         (std::ceil(grads / bucket) - 1) * links.latency_s,
                                     all_reduce_seconds(bucket, g, links), backward, links);
    } else if (n > 1 && layout.zero_stage <= 2) {
      exposed = overlapped_reduction(reduce_scatter_seconds(grads, g, links) +
                                         (std::ceil(grads / bucket) - 1) * links.latency_s,
                                     reduce_scatter_seconds(bucket, g, links), backward, links) +
                all_gather_seconds(gathered_weight_bytes(job, cfg.num_parameters(), static_cast<int64_t>(matrices)),
                                   g, links);
    } else if (n > 1) {
      const int64_t unit = models::gpt_block_parameters(cfg);
      const double unit_bytes = gathered_weight_bytes(job, unit, 12 * cfg.width * cfg.width);
      const double root_bytes = 4.0 * static_cast<double>(models::gpt_root_parameters(cfg));
      // The forward's gathers hide under the forward (a third of the
      // compute), the backward's gathers and reduce-scatters under the
      // backward; the first unit's gather waits, and so does the root's.
      const double layers = static_cast<double>(cfg.layers);
      const double gather = all_gather_seconds(unit_bytes, g, links);
      const double forward_comm = layers * gather + all_gather_seconds(root_bytes, g, links);
      const double backward_comm = layers * (gather + reduce_scatter_seconds(4.0 * unit, g, links)) +
                                   reduce_scatter_seconds(root_bytes, g, links);
      exposed = gather + std::max(0.0, forward_comm - gather - fwd_bwd / 3.0) +
                std::max(0.0, backward_comm - backward) +
                contention(std::min(forward_comm - gather, fwd_bwd / 3.0) + std::min(backward_comm, backward), links);
    }
    step = compute + exposed;
  } else {
    const int64_t tp = layout.tp, pp = layout.pp, m = layout.micro_batches, v = layout.virtual_stages;
    const int64_t mb_tokens = job.batch * tp * pp / m * job.seq;
    const KernelRates& k = rates->at(mb_tokens);
    const double adamw = 1.0 / k.optimizer_params;
    // Note [Cost model], pipeline: the stages as chorus train and chorus
    // bench lay them out (parallel::balance_ranks, Note [Pipeline stages by
    // cost]); the slot is the slowest pipeline rank's micro-batch, its V
    // stages together.
    const int64_t blocks_all = cfg.layers;
    std::vector<int64_t> balance = pp > 1 ? parallel::balance_ranks(models::pipeline_layer_costs(cfg, job.seq), pp, v) : std::vector<int64_t>{blocks_all + 2};
    const double block_s = micro_batch_compute_seconds(job, k, mb_tokens, tp, 1, false);
    const double head_s = micro_batch_compute_seconds(job, k, mb_tokens, tp, 0, true);
    // What a pipeline's micro-batch does that the calibrated pieces do not,
    // memory-bound work timed by AdamW's rate: its fused float32 update reads
    // a parameter, its gradient and two moments and writes three of them, 28
    // bytes a parameter, so memory moves 28 R_adamw bytes a second.
    const double mem_bw = 28.0 * k.optimizer_params;
    // (1) Every micro-batch but the step's first adds each weight gradient
    // into .grad in place (autograd's AccumulateGrad: read both, write one
    // float, 12 bytes a parameter); the calibration times a block with its
    // gradients zeroed, as a one-backward step runs.
    const double accumulate = static_cast<double>(m - 1) / static_cast<double>(m) * 12.0 / mem_bw;
    // (2) The mesh's head writes the logits [N, Vp/tp] (s bytes each) and its
    // vocabulary-parallel loss passes over them (Note [Vocabulary-parallel
    // loss in place]: a float copy, the row maximum, the shift and the
    // exponential in place, the row sum; the backward's scale in place and
    // the copy back into the logits' dtype over the padded width): 4 s + 40
    // bytes a logit, where the calibrated classifier fuses the loss.
    const double logits = static_cast<double>(mb_tokens) * static_cast<double>(cfg.padded_vocab) / static_cast<double>(tp);
    const double loss_passes = (4.0 * s + 40.0) * logits / mem_bw;
    const double block_params = static_cast<double>(models::gpt_block_parameters(cfg)) / static_cast<double>(tp);
    const double wte_params = static_cast<double>(cfg.padded_vocab * cfg.width) / static_cast<double>(tp);
    std::vector<double> rank_s(static_cast<size_t>(pp), 0.0);
    std::vector<int64_t> rank_blocks(static_cast<size_t>(pp), 0);
    for (size_t st = 0, first = 0; st < balance.size(); ++st) {
      const size_t last = first + static_cast<size_t>(balance[st]);  // layers [first, last): 0 embeddings, L + 1 head
      const bool has_emb = first == 0, has_head = last == static_cast<size_t>(blocks_all) + 2;
      const int64_t blocks = static_cast<int64_t>(last - first) - (has_emb ? 1 : 0) - (has_head ? 1 : 0);
      const double params = static_cast<double>(blocks) * block_params + (has_emb ? wte_params : 0.0) +
                            (has_head ? wte_params : 0.0);
      double t = static_cast<double>(blocks) * block_s + (has_head ? head_s + loss_passes : 0.0);
      if (pp > 1) t += params * accumulate;
      rank_s[st % static_cast<size_t>(pp)] += t;
      rank_blocks[st % static_cast<size_t>(pp)] += blocks;
      first = last;
    }
    const size_t slowest = static_cast<size_t>(std::max_element(rank_s.begin(), rank_s.end()) - rank_s.begin());
    const double mb = rank_s[slowest];
    const int64_t blocks = rank_blocks[slowest];
    const Group tg{tp, tp};
    const double act = static_cast<double>(mb_tokens) * static_cast<double>(cfg.width) * s;
    // Sequence parallel: each of the block's 4 all-reduces is an all-gather
    // and a reduce-scatter (Note [Cost model]).
    const double tensor_comm =
        tp > 1 ? 4.0 * static_cast<double>(blocks) * (all_gather_seconds(act, tg, links) + reduce_scatter_seconds(act, tg, links)) +
                     2.0 * all_reduce_seconds(4.0 * static_cast<double>(mb_tokens), tg, links)
               : 0.0;
    // One activation and one gradient a slot; each message is a header
    // (dtype and shape) and then the tensor, whose receive is posted once
    // the header is on the host: one more latency each (Note [Pipeline
    // links] in parallel/pipeline_links.h).
    const double p2p = pp > 1 ? 2.0 * (links.latency_s + send_recv_seconds(act / static_cast<double>(tp),
                                                                          tp * pp > job.gpus_per_node, links))
                              : 0.0;
    const double slot = mb + tensor_comm + p2p;
    const double pipeline = static_cast<double>(v * m + pp - 1) / static_cast<double>(v) * slot;
    bubble = pipeline_bubble(pp, m, v);
    const double local = static_cast<double>(mesh_parameters_per_gpu(cfg, tp, pp));
    const Group g = data_group(job, layout.dp, tp * pp);
    double dp_comm = 0;
    if (layout.dp > 1) {
      const double grads = 4.0 * local, bucket = std::min(grads, static_cast<double>(job.bucket_bytes));
      const double all = all_reduce_seconds(grads, g, links) + (std::ceil(grads / bucket) - 1) * links.latency_s;
      dp_comm = pp == 1 ? overlapped_reduction(all, all_reduce_seconds(bucket, g, links), mb * 2.0 / 3.0, links) : all;
    }
    compute = static_cast<double>(m) * mb + local * adamw;
    step = pipeline + dp_comm + local * adamw;
    exposed = step - compute - bubble * pipeline;
  }
  p.step_s = step;
  p.compute_s = compute;
  p.exposed_comm_s = std::max(0.0, exposed);
  p.bubble = bubble;
  p.tok_s = tokens_per_step / step;
  if (rates->peak_flops > 0)
    p.mfu = cfg.flops_per_token(job.seq) * *p.tok_s / (rates->peak_flops * static_cast<double>(job.gpus));
  return p;
}

std::vector<Prediction> plan_layouts(const Job& job, const std::optional<Rates>& rates) {
  std::vector<Prediction> out;
  for (const Layout& l : layouts_worth_trying(job)) out.push_back(predict(job, l, rates));
  std::stable_sort(out.begin(), out.end(), [](const Prediction& a, const Prediction& b) {
    if (a.fits != b.fits) return a.fits;
    if (a.step_s && b.step_s && *a.step_s != *b.step_s) return *a.step_s < *b.step_s;
    return a.memory.needed() < b.memory.needed();
  });
  return out;
}

}  // namespace chorus::plan
