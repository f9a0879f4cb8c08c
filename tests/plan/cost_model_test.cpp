// The planner's cost model (plan/cost_model.h) against closed forms worked
// out by hand, its memory column against dist::plan_for built from the
// model's own counts, and the calibration file's round trip and refusals.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "chorus/data_parallel/memory_plan.h"
#include "chorus/models/gpt.h"
#include "chorus/models/gpt_memory.h"
#include "chorus/plan/calibration.h"
#include "chorus/plan/cost_model.h"
#include "chorus/plan/gpt_layout_memory.h"
#include "chorus/models/gpt_pipeline.h"
#include "chorus/parallel/placement.h"
#include "testing/expect_error.h"

using namespace chorus;
using namespace chorus::plan;

namespace plan_cost_model_test {

std::mt19937_64& rng() {
  static std::mt19937_64 g(20261128);
  return g;
}
double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng()); }

Links random_links() {
  Links l;
  l.nvlink_busbw = uniform(100e9, 500e9);
  l.nic_bw = uniform(10e9, 60e9);
  l.latency_s = uniform(1e-6, 50e-6);
  return l;
}

TEST(PlanCostModel, RingCollectivesInsideANode) {
  for (int trial = 0; trial < 20; ++trial) {
    const Links l = random_links();
    const int64_t n = 2 + static_cast<int64_t>(uniform(0, 7));
    const double bytes = uniform(1e3, 1e10);
    const double bw_term = static_cast<double>(n - 1) / static_cast<double>(n) * bytes / l.nvlink_busbw;
    EXPECT_NEAR(all_reduce_seconds(bytes, {n, n}, l), l.latency_s + 2 * bw_term, 1e-12 * (1 + 2 * bw_term));
    EXPECT_NEAR(reduce_scatter_seconds(bytes, {n, n}, l), l.latency_s + bw_term, 1e-12 * (1 + bw_term));
    EXPECT_NEAR(all_gather_seconds(bytes, {n, n}, l), l.latency_s + bw_term, 1e-12 * (1 + bw_term));
  }
  EXPECT_EQ(all_reduce_seconds(1e9, {1, 1}, random_links()), 0.0);
}

TEST(PlanCostModel, HierarchicalAllReduceAcrossNodes) {
  // 4 nodes of 8: reduce-scatter in the node (7/8 B over NVLink), all-reduce
  // of B/8 across 4 nodes (2 x 3/4 x B/8 over the NIC), all-gather (7/8 B).
  const Links l = random_links();
  const double b = uniform(1e6, 1e10);
  const double expect = l.latency_s + 2 * 7.0 / 8 * b / l.nvlink_busbw + 2 * 3.0 / 4 * (b / 8) / l.nic_bw;
  EXPECT_NEAR(all_reduce_seconds(b, {32, 8}, l), expect, 1e-12 * expect);
  // One GPU a node: a flat ring over the NICs.
  const double flat = l.latency_s + 2 * 15.0 / 16 * b / l.nic_bw;
  EXPECT_NEAR(all_reduce_seconds(b, {16, 1}, l), flat, 1e-12 * flat);
  EXPECT_NEAR(send_recv_seconds(b, true, l), l.latency_s + b / l.nic_bw, 1e-12 * b / l.nic_bw);
  EXPECT_NEAR(send_recv_seconds(b, false, l), l.latency_s + b / l.nvlink_busbw, 1e-12 * b / l.nvlink_busbw);
}

TEST(PlanCostModel, PipelineBubble) {
  EXPECT_DOUBLE_EQ(pipeline_bubble(4, 16), 3.0 / 19);
  EXPECT_DOUBLE_EQ(pipeline_bubble(4, 16, 2), 3.0 / 35);
  EXPECT_DOUBLE_EQ(pipeline_bubble(1, 8), 0.0);
  EXPECT_DOUBLE_EQ(pipeline_bubble(8, 8, 4), 7.0 / 39);
  EXPECT_TRUE(test::throws_naming([] { pipeline_bubble(0, 4); }, {"pipeline"}));
}

// All rates equal R and nothing outside the matrices and attention: a
// micro-batch's compute times R is the FLOPs of GPTConfig::flops_per_token
// less 6 N x (the norms' and biases' 13 C a block, the positions, ln_f).
TEST(PlanCostModel, ComputeIsTheTrainingFlops) {
  for (const char* name : {"d12", "gpt2-xl", "d84"}) {
    Job job;
    job.cfg = models::GPTConfig::named(name);
    job.seq = 1024;
    const double r = uniform(1e12, 1e15);
    KernelRates k;
    k.gemm_flops = k.attention_flops = k.classifier_flops = r;
    const int64_t n = 8 * 1024;
    const double c = static_cast<double>(job.cfg.width), l = static_cast<double>(job.cfg.layers);
    const double flops = job.cfg.flops_per_token(job.seq) * n -
                         6.0 * n * (13 * c * l + static_cast<double>(job.cfg.context) * c + 2 * c);
    const double got = micro_batch_compute_seconds(job, k, n, 1, job.cfg.layers, true) * r;
    EXPECT_NEAR(got, flops, 1e-9 * flops) << name;
    // Tensor parallel: a quarter each; recompute: the blocks' forward again (x 4/3).
    const double head = 6.0 * n * c * static_cast<double>(job.cfg.padded_vocab);
    EXPECT_NEAR(micro_batch_compute_seconds(job, k, n, 4, job.cfg.layers, true) * r, got / 4, 1e-9 * got) << name;
    // A rate timed at tp = 4's shard shapes replaces the whole matrices' for
    // the block's GEMM term only (72 N C^2 L / 4 at half the rate).
    KernelRates shard = k;
    shard.gemm_flops_shards = {{4, r / 2}};
    const double gemm = 72.0 * n * c * c * l;
    EXPECT_NEAR(micro_batch_compute_seconds(job, shard, n, 4, job.cfg.layers, true) * r, got / 4 + gemm / 4,
                1e-9 * got)
        << name;
    EXPECT_DOUBLE_EQ(shard.gemm_rate(2), r);
    // A CUDA graph's ratios scale the blocks and the head, each its own.
    KernelRates graphed = k;
    graphed.graph_block = uniform(0.5, 1.0);
    graphed.graph_classifier = uniform(0.5, 1.0);
    EXPECT_NEAR(micro_batch_compute_seconds(job, graphed, n, 1, job.cfg.layers, true, true) * r,
                (got - head) * graphed.graph_block + head * graphed.graph_classifier, 1e-9 * got)
        << name;
    EXPECT_NEAR(micro_batch_compute_seconds(job, graphed, n, 1, job.cfg.layers, true, false) * r, got, 1e-9 * got);
    job.cfg.recompute_blocks = job.cfg.layers;
    EXPECT_NEAR(micro_batch_compute_seconds(job, k, n, 1, job.cfg.layers, true) * r, (got - head) * 4 / 3 + head,
                1e-9 * got)
        << name;
    // A timed recompute ratio replaces 4/3.
    KernelRates timed = k;
    timed.recompute = uniform(1.2, 1.6);
    EXPECT_NEAR(micro_batch_compute_seconds(job, timed, n, 1, job.cfg.layers, true) * r,
                (got - head) * timed.recompute + head, 1e-9 * got)
        << name;
    // --recompute N: the ratio on N of the L blocks only.
    job.cfg.recompute_blocks = job.cfg.layers / 2;
    const double part = static_cast<double>(job.cfg.layers / 2) / static_cast<double>(job.cfg.layers);
    EXPECT_NEAR(micro_batch_compute_seconds(job, timed, n, 1, job.cfg.layers, true) * r,
                (got - head) * (1 + part * (timed.recompute - 1)) + head, 1e-9 * got)
        << name;
  }
}

TEST(PlanCostModel, GraphedLayoutsAreChorusTrainsGraphedSteps) {
  EXPECT_TRUE(step_is_graphed({"single"}));
  EXPECT_TRUE(step_is_graphed({"ddp", 0, 4}));
  EXPECT_TRUE(step_is_graphed({"zero", 1, 4}));
  EXPECT_TRUE(step_is_graphed({"zero", 2, 4}));
  EXPECT_FALSE(step_is_graphed({"zero", 3, 4}));
  EXPECT_FALSE(step_is_graphed({"mesh", 0, 1, 2, 2, 4, 1}));
}

TEST(PlanCostModel, RatesAtTheNearestTokens) {
  Rates r;
  r.kernels.tokens = 8192;
  r.kernels.gemm_flops = 1;
  KernelRates small, large;
  small.tokens = 2048;
  small.gemm_flops = 2;
  large.tokens = 32768;
  large.gemm_flops = 3;
  r.more = {small, large};
  EXPECT_EQ(r.at(8192).gemm_flops, 1);
  EXPECT_EQ(r.at(2048).gemm_flops, 2);
  EXPECT_EQ(r.at(1024).gemm_flops, 2);
  EXPECT_EQ(r.at(3000).gemm_flops, 2);  // nearer 2048 than 8192 in ratio
  EXPECT_EQ(r.at(5000).gemm_flops, 1);
  EXPECT_EQ(r.at(1 << 20).gemm_flops, 3);
}

// The DDP/ZeRO column is `chorus train`'s plan: dist::plan_for over the
// inputs taken from the model's counts as apps/memory_check.cpp took them.
TEST(PlanCostModel, DataParallelMemoryIsTheMemoryPlan) {
  for (const char* name : {"gpt2", "gpt2-xl", "d84"}) {
    for (auto [bf16, gather] : {std::pair{true, ""}, std::pair{true, "fp32"}, std::pair{false, ""}}) {
      Job job;
      job.cfg = models::GPTConfig::named(name);
      job.gpus = 4;
      job.batch = 8;
      job.seq = 1024;
      job.bf16 = bf16;
      job.zero_param_dtype = gather;
      dist::MemoryPlanInputs in;
      in.params = job.cfg.num_parameters();
      in.autocast_copied = models::gpt_autocast_copied_parameters(job.cfg);
      in.largest_unit_params = models::gpt_block_parameters(job.cfg);
      in.root_unit_params = models::gpt_root_parameters(job.cfg);
      in.bf16 = bf16;
      if (bf16 && std::string(gather) != "fp32") {
        in.low_precision_unit_params = 12 * job.cfg.width * job.cfg.width;
        in.low_precision_params = job.cfg.layers * in.low_precision_unit_params;
      }
      const bool fused = bf16 && job.cfg.head_dim() <= 128;
      in.activation_bytes = models::gpt_activation_bytes(job.cfg, 8, 1024, bf16, fused).total();
      for (const Layout& l : {Layout{"ddp", 0, 4}, Layout{"zero", 1, 4}, Layout{"zero", 2, 4}, Layout{"zero", 3, 4}}) {
        dist::MemoryStrategy s;
        s.name = l.kind;
        s.zero_stage = l.zero_stage;
        s.world = 4;
        const dist::MemoryPlan want = dist::plan_for(s, in);
        const dist::MemoryPlan got = layout_memory(job, l);
        EXPECT_EQ(got.total(), want.total()) << name << " " << l.name() << " " << gather;
        EXPECT_EQ(got.weights, want.weights);
        EXPECT_EQ(got.optimizer, want.optimizer);
        EXPECT_EQ(*got.activations, *want.activations);
      }
    }
  }
}

// Note [Tensor and pipeline memory] by hand for d12 (C = 768, 12 blocks of
// 12 C^2 + 13 C = 7,087,872 parameters, of which 4 C are norms) at tp=2,
// pp=2, bf16: 6 blocks of half; the first stage's token embedding half
// (50304 x 768 / 2) and positions (1024 x 768) outweigh the last's ln_f.
TEST(PlanCostModel, TensorPipelineMemoryByHand) {
  const models::GPTConfig cfg = models::GPTConfig::named("d12");
  const int64_t block = 7'087'872, wte_half = 50'304 * 768 / 2, wpe = 1024 * 768;
  const int64_t p = 6 * block / 2 + wte_half + wpe;
  EXPECT_EQ(mesh_parameters_per_gpu(cfg, 2, 2), p);
  const int64_t copied = 6 * (block - 4 * 768) / 2 + wte_half;
  GptMemoryRun run;
  run.batch = 4;
  run.seq = 1024;
  run.bf16 = true;
  run.fused_attention = true;
  const dist::MemoryPlan m = mesh_memory_plan(cfg, run, 4, 2, 2, 8, 1);
  EXPECT_EQ(m.weights, 4 * p + 2 * copied);
  EXPECT_EQ(m.gradients, 4 * p);
  EXPECT_EQ(m.optimizer, 8 * p);
  // Activations: 6 blocks' worth for min(m, pp) = 2 micro-batches in flight, over tp.
  models::GPTConfig stage = cfg;
  stage.layers = 6;
  // The mesh's vocabulary-parallel loss keeps its gradient beside the logits.
  const models::GPTActivationBytes a = models::gpt_activation_bytes(stage, 4, 1024, true, true, false);
  EXPECT_EQ(*m.activations, a.embeddings + a.blocks * 2 / 2 + a.peak / 2);
  // Interleaved over v = 2: x (1 + (pp-1)/(pp v)) = 1.25 of that.
  const dist::MemoryPlan mi = mesh_memory_plan(cfg, run, 4, 2, 2, 8, 2);
  EXPECT_EQ(*mi.activations, a.embeddings + std::llround(static_cast<double>(a.blocks) * 2 * 1.25 / 2) + a.peak / 2);
  // tp = pp = 1 is DDP's plan, but for the classifier's gradient, which
  // DDP's loss writes over the logits and the mesh's keeps beside them.
  GptMemoryRun r1 = run;
  dist::MemoryStrategy ddp;
  ddp.name = "ddp";
  ddp.world = 4;
  dist::MemoryPlanInputs kept = gpt_memory_inputs(cfg, r1);
  kept.activation_bytes =
      models::gpt_activation_bytes(cfg, r1.batch, r1.seq, r1.bf16, r1.fused_attention, false).total();
  EXPECT_EQ(mesh_memory_plan(cfg, r1, 4, 1, 1, 1, 1).total(), dist::plan_for(ddp, kept).total());
  EXPECT_LT(dist::plan_for(ddp, gpt_memory_inputs(cfg, r1)).total(), dist::plan_for(ddp, kept).total());
}

TEST(PlanCostModel, LayoutsMultiplyToTheGpusAndKeepTensorsInANode) {
  for (const char* name : {"gpt2-xl", "d84", "d12"}) {
    for (int64_t gpus : {1, 4, 64, 1024}) {
      Job job;
      job.cfg = models::GPTConfig::named(name);
      job.gpus = gpus;
      job.batch = 4;
      const std::vector<Layout> ls = layouts_worth_trying(job);
      ASSERT_FALSE(ls.empty());
      for (const Layout& l : ls) {
        EXPECT_EQ(l.gpus(), gpus) << l.name();
        EXPECT_LE(l.tp, 8);
        EXPECT_EQ(job.cfg.heads % l.tp, 0) << l.name();
        EXPECT_LE(l.pp, job.cfg.layers);
        EXPECT_EQ(job.batch * l.tp * l.pp % l.micro_batches, 0) << l.name();
        EXPECT_TRUE(l.pp > 1 || l.micro_batches == 1);
      }
    }
  }
  Job job;
  job.cfg = models::GPTConfig::named("gpt2-xl");
  job.gpus = 12;
  EXPECT_TRUE(test::throws_naming([&] { validate(job); }, {"--gpus 12", "--gpus-per-node 8"}));
  job.gpus = 4;
  job.seq = 4096;
  EXPECT_TRUE(test::throws_naming([&] { validate(job); }, {"--seq-len 4096", "context"}));
}

// DDP on one node whose all-reduce hides under the backward: only the last
// bucket's shows; with a slow link, what the backward cannot hide shows too.
TEST(PlanCostModel, DdpOverlapsAllButTheLastBucket) {
  Job job;
  job.cfg = models::GPTConfig::named("d12");
  job.gpus = 4;
  job.batch = 4;
  job.bucket_bytes = 25 << 20;
  Rates r;
  r.kernels.gemm_flops = r.kernels.attention_flops = r.kernels.classifier_flops = 2e14;
  r.kernels.optimizer_params = 1e10;
  r.peak_flops = 1e15;
  Links l;
  l.nvlink_busbw = 300e9;
  l.latency_s = 0;
  r.links = l;
  r.kernels.graph_block = 0.9;
  r.kernels.graph_classifier = 0.95;
  r.kernels.graph_optimizer = 0.5;
  const Prediction p = predict(job, {"ddp", 0, 4}, r);
  const Group g{4, 4};
  EXPECT_NEAR(*p.exposed_comm_s, all_reduce_seconds(25 << 20, g, l), 1e-12);
  // DDP's step is one CUDA graph: the graph ratios apply, AdamW's too.
  const double fwd_bwd = micro_batch_compute_seconds(job, r.kernels, 4 * 1024, 1, job.cfg.layers, true, true);
  const double P = static_cast<double>(job.cfg.num_parameters());
  EXPECT_NEAR(*p.step_s, fwd_bwd + P * 0.5 / 1e10 + *p.exposed_comm_s, 1e-12);
  EXPECT_NEAR(*p.tok_s, 4.0 * 1024 * 4 / *p.step_s, 1e-6);
  EXPECT_NEAR(*p.mfu, job.cfg.flops_per_token(1024) * *p.tok_s / 4e15, 1e-12);
  l.nvlink_busbw = 1e9;  // the gradients' all-reduce now outlasts the backward
  r.links = l;
  const Prediction slow = predict(job, {"ddp", 0, 4}, r);
  r.kernels.graph_block = r.kernels.graph_classifier = r.kernels.graph_optimizer = 1;
  const double all = all_reduce_seconds(4 * P, g, l), backward = fwd_bwd * 2 / 3;
  EXPECT_NEAR(*slow.exposed_comm_s, all - backward, 1e-9);
  // Compute beside the collectives slowed f times: the overlap (the whole
  // backward here, the reduction outlasting it) costs (f - 1) x backward more.
  l.overlap_slowdown = 1.25;
  r.links = l;
  const Prediction contended = predict(job, {"ddp", 0, 4}, r);
  const double eager_backward =
      micro_batch_compute_seconds(job, r.kernels, 4 * 1024, 1, job.cfg.layers, true, true) * 2 / 3;
  EXPECT_NEAR(*contended.exposed_comm_s, all - eager_backward + 0.25 * eager_backward, 1e-9);
  // On the fast link the rest of the reduction (all but the last bucket) is the overlap.
  l.nvlink_busbw = 300e9;
  r.links = l;
  const Prediction fast = predict(job, {"ddp", 0, 4}, r);
  const double rest = all_reduce_seconds(4 * P, g, l) - all_reduce_seconds(25 << 20, g, l);
  EXPECT_NEAR(*fast.exposed_comm_s, all_reduce_seconds(25 << 20, g, l) + 0.25 * rest, 1e-12);
  // No rates: memory only.
  const Prediction mem = predict(job, {"ddp", 0, 4}, std::nullopt);
  EXPECT_FALSE(mem.step_s.has_value());
  EXPECT_GT(mem.memory.total(), 0);
}

Rates flat_rates(double busbw) {
  Rates r;
  r.kernels.gemm_flops = r.kernels.attention_flops = r.kernels.classifier_flops = 2e14;
  r.kernels.optimizer_params = 1e10;
  Links l;
  l.nvlink_busbw = busbw;
  l.nic_bw = 50e9;
  l.latency_s = 10e-6;
  r.links = l;
  return r;
}

// ZeRO-3 over a slow link: the forward's gathers (48 units in bf16 matrices
// plus the float32 root) beyond the forward, the backward's gathers and
// reduce-scatters beyond the backward, and the first gather, all show.
TEST(PlanCostModel, Zero3ExposesWhatTheComputeCannotHide) {
  Job job;
  job.cfg = models::GPTConfig::named("gpt2-xl");
  job.gpus = 4;
  job.batch = 8;
  Rates r = flat_rates(2e9);
  r.kernels.graph_block = r.kernels.graph_classifier = r.kernels.graph_optimizer = 0.5;  // eager: not applied
  const Links& l = *r.links;
  const Group g{4, 4};
  const double c = 1600, u = static_cast<double>(models::gpt_block_parameters(job.cfg));
  const double unit_bytes = 2 * 12 * c * c + 4 * (u - 12 * c * c);
  const double root = 4.0 * static_cast<double>(models::gpt_root_parameters(job.cfg));
  const double q = 3.0 / 4;  // (n-1)/n
  const double gather = l.latency_s + q * unit_bytes / l.nvlink_busbw;
  const double scatter = l.latency_s + q * 4 * u / l.nvlink_busbw;
  const double root_move = l.latency_s + q * root / l.nvlink_busbw;
  const double fwd_bwd = micro_batch_compute_seconds(job, r.kernels, 8 * 1024, 1, 48, true);
  const double want = gather + std::max(0.0, 48 * gather + root_move - gather - fwd_bwd / 3) +
                      std::max(0.0, 48 * (gather + scatter) + root_move - fwd_bwd * 2 / 3);
  const Prediction p = predict(job, {"zero", 3, 4}, r);
  EXPECT_NEAR(*p.exposed_comm_s, want, 1e-9 * want);
  EXPECT_GT(*p.exposed_comm_s, gather);  // the link is slow enough to show
  const double P = static_cast<double>(job.cfg.num_parameters());
  EXPECT_NEAR(*p.step_s, fwd_bwd + P / 4 / 1e10 + want, 1e-9 * *p.step_s);
  // With a contention factor the forward and the backward, each overlapped
  // whole (the link is slow), cost (f - 1) x their length more.
  Rates contended = r;
  contended.links->overlap_slowdown = 1.5;
  const Prediction slowed = predict(job, {"zero", 3, 4}, contended);
  EXPECT_NEAR(*slowed.exposed_comm_s, want + 0.5 * fwd_bwd, 1e-9 * want);
}

// A 2-stage 1F1B pipeline of 4 micro-batches on one node: 5 slots of the
// slower stage's micro-batch plus an activation sent and a gradient received,
// each a header and a tensor. The stages are parallel::balance_ranks's: d12's
// head is 4.9 blocks of work, so 9 and 5 layers (8 blocks, then 4 and the
// head). The head's stage also writes the logits and passes over them in the
// vocabulary-parallel loss (48 bytes a logit in bf16), and 3 of the 4
// micro-batches add the stage's weight gradients into .grad (12 bytes a
// parameter), both at AdamW's 28 bytes a parameter.
TEST(PlanCostModel, PipelineStepIsSlotsTimesTheStage) {
  Job job;
  job.cfg = models::GPTConfig::named("d12");
  job.gpus = 2;
  job.batch = 4;
  Rates r = flat_rates(300e9);
  r.kernels.tokens = 4 * 1024;
  // Rates timed at the micro-batch's 2048 tokens: the ones the slot runs at.
  KernelRates at_mb = r.kernels;
  at_mb.tokens = 2 * 1024;
  at_mb.gemm_flops = 1e14;
  at_mb.optimizer_params = 2e10;
  r.more = {at_mb};
  const Layout layout{"mesh", 0, 1, 1, 2, 4, 1};
  const int64_t mb_tokens = 4 * 2 / 4 * 1024;
  EXPECT_EQ(parallel::balance_ranks(models::pipeline_layer_costs(job.cfg, job.seq), 2), (std::vector<int64_t>{9, 5}));
  const double mem_bw = 28 * 2e10;
  const double params = 4.0 * static_cast<double>(models::gpt_block_parameters(job.cfg)) + 50304.0 * 768;
  const double mb = micro_batch_compute_seconds(job, at_mb, mb_tokens, 1, 4, true) +
                    48.0 * mb_tokens * 50304 / mem_bw + 3.0 / 4 * 12 * params / mem_bw;
  const double p2p = 2 * (2 * r.links->latency_s + mb_tokens * 768.0 * 2 / r.links->nvlink_busbw);
  const double local = static_cast<double>(mesh_parameters_per_gpu(job.cfg, 1, 2));
  const Prediction p = predict(job, layout, r);
  EXPECT_NEAR(*p.step_s, 5 * (mb + p2p) + local / 2e10, 1e-12);
  EXPECT_DOUBLE_EQ(*p.bubble, 1.0 / 5);
  EXPECT_NEAR(*p.exposed_comm_s, 4 * p2p, 1e-12);
}

// Tensor parallel with sequence parallelism: each block's 4 all-reduces are
// an all-gather and a reduce-scatter each (2 latencies), plus the loss's 2
// all-reduces of N floats, all on the critical path.
TEST(PlanCostModel, SequenceParallelCollectivesOnTheCriticalPath) {
  Job job;
  job.cfg = models::GPTConfig::named("d12");
  job.gpus = 2;
  job.batch = 4;
  const Rates r = flat_rates(300e9);
  const Layout layout{"mesh", 0, 1, 2, 1, 1, 1};
  const double n = 4 * 2 * 1024, lat = r.links->latency_s, bw = r.links->nvlink_busbw;
  const double act = n * 768 * 2;
  const double half = lat + 0.5 * act / bw;  // an all-gather or a reduce-scatter over 2
  const double loss = lat + 2 * 0.5 * 4 * n / bw;
  // The vocabulary-parallel loss's passes over this rank's half of the logits (48 bytes each in bf16).
  const double mb = micro_batch_compute_seconds(job, r.kernels, static_cast<int64_t>(n), 2, 12, true) +
                    48.0 * n * 50304 / 2 / (28 * 1e10);
  const double local = static_cast<double>(mesh_parameters_per_gpu(job.cfg, 2, 1));
  const Prediction p = predict(job, layout, r);
  EXPECT_NEAR(*p.step_s, mb + 4 * 12 * 2 * half + 2 * loss + local / 1e10, 1e-12);
}

TEST(PlanCostModel, BusBandwidthFit) {
  const double a = uniform(5e-6, 40e-6), bw = uniform(100e9, 400e9);
  std::vector<std::pair<int64_t, double>> rows;
  for (int64_t mb : {1, 16, 64, 256}) {
    const int64_t b = mb << 20;
    rows.emplace_back(b, a + 2.0 * 3 / 4 * static_cast<double>(b) / bw);
  }
  const BusBandwidth fit = fit_bus_bandwidth(4, rows);
  EXPECT_NEAR(fit.busbw, bw, 1e-6 * bw);
  EXPECT_NEAR(fit.latency_s, a, 1e-9);
  EXPECT_TRUE(test::throws_naming([] { fit_bus_bandwidth(1, {{1, 1.0}}); }, {"2 ranks"}));
}

Calibration sample_calibration() {
  Calibration c;
  c.device = "cuda:0";
  c.device_name = "Some GPU";
  c.commit = "abc1234";
  c.precision = "bf16";
  c.peak_flops = 1e15;
  c.memory_bytes = int64_t{80} << 30;
  ModelTiming t;
  t.model = "gpt2-xl";
  t.width = 1600;
  t.heads = 25;
  t.seq = 1024;
  t.tokens = 8192;
  t.padded_vocab = 50304;
  t.gemm = {0.01, 5e12, 5e14};
  t.attention = {0.002, 4e11, 2e14};
  t.classifier = {0.004, 2e12, 5e14};
  t.other = {0.001, 1.3e7, 1.3e10};
  t.optimizer = {0.0005, 3e7, 6e10};
  t.block = {0.013, 5.4e12, 4e14};
  t.gemm_shards = {{2, {0.006, 2.5e12, 4.2e14}}, {4, {0.0035, 1.25e12, 3.6e14}}};
  t.recompute = {0.0169, 5.4e12, 5.4e12 / 0.0169};
  t.graph_block = ClassTiming{0.0117, 5.4e12, 5.4e12 / 0.0117};
  t.graph_optimizer = ClassTiming{0.00025, 3e7, 1.2e11};
  c.models.push_back(t);
  BusBandwidth b;
  b.ranks = 2;
  b.busbw = 3e11;
  b.latency_s = 2e-5;
  b.rows = {{1 << 20, 3e-5}, {256 << 20, 9e-4}};
  b.overlap_slowdown = 1.12;
  c.bus = b;
  return c;
}

TEST(PlanCalibration, RoundTripAndNearestWidth) {
  const Calibration c = sample_calibration();
  const Calibration back = parse_calibration(calibration_json(c), "test");
  EXPECT_EQ(back.device_name, c.device_name);
  EXPECT_EQ(back.commit, c.commit);
  ASSERT_EQ(back.models.size(), 1u);
  EXPECT_DOUBLE_EQ(back.models[0].gemm.rate, 5e14);
  EXPECT_DOUBLE_EQ(back.models[0].rates().optimizer_params, 6e10);
  ASSERT_EQ(back.models[0].gemm_shards.size(), 2u);
  EXPECT_EQ(back.models[0].gemm_shards[1].first, 4);
  EXPECT_DOUBLE_EQ(back.models[0].rates().gemm_rate(4), 3.6e14);
  EXPECT_DOUBLE_EQ(back.models[0].rates().gemm_rate(8), 5e14);
  ASSERT_TRUE(back.bus.has_value());
  EXPECT_NEAR(back.bus->busbw, 3e11, 1);
  EXPECT_NEAR(back.bus->latency_s, 2e-5, 1e-15);
  EXPECT_DOUBLE_EQ(back.bus->overlap_slowdown, 1.12);
  bool exact = true;
  EXPECT_EQ(timing_for(back, models::GPTConfig::named("gpt2-xl"), 1024, &exact).model, "gpt2-xl");
  EXPECT_TRUE(exact);
  EXPECT_EQ(timing_for(back, models::GPTConfig::named("d84"), 1024, &exact).model, "gpt2-xl");
  EXPECT_FALSE(exact);
  // Version 2: the recompute and graph ratios (the classifier's graph not
  // captured: ratio 1).
  const KernelRates k = back.models[0].rates();
  EXPECT_NEAR(k.recompute, 1.3, 1e-12);
  EXPECT_NEAR(k.graph_block, 0.9, 1e-12);
  EXPECT_NEAR(k.graph_optimizer, 0.5, 1e-12);
  EXPECT_EQ(k.graph_classifier, 1.0);
  EXPECT_FALSE(back.models[0].graph_classifier.has_value());
}

TEST(PlanCalibration, MicroBatchSizesOfOneModel) {
  Calibration c = sample_calibration();
  ModelTiming small = c.models[0];
  small.tokens = 2048;
  small.gemm = {0.004, 5e12 / 4, 3.1e14};
  c.models.push_back(small);
  const Calibration back = parse_calibration(calibration_json(c), "test");
  const models::GPTConfig xl = models::GPTConfig::named("gpt2-xl");
  bool exact = false;
  EXPECT_EQ(timing_for(back, xl, 1024, &exact, 8192).tokens, 8192);
  EXPECT_EQ(timing_for(back, xl, 1024, &exact, 2048).tokens, 2048);
  EXPECT_EQ(timing_for(back, xl, 1024, &exact, 1024).tokens, 2048);
  EXPECT_TRUE(exact);
  // The rates hold both: the plan's batch first, the other in `more`.
  const Rates r = rates_for(back, timing_for(back, xl, 1024, &exact, 8192));
  EXPECT_EQ(r.kernels.tokens, 8192);
  ASSERT_EQ(r.more.size(), 1u);
  EXPECT_DOUBLE_EQ(r.at(2048).gemm_flops, 3.1e14);
  EXPECT_DOUBLE_EQ(r.peak_flops, 1e15);
}

// A version 1 file (before recompute and graph timings) is read with a
// recompute ratio of 4/3 and graph ratios of 1; another version is refused.
TEST(PlanCalibration, VersionOneFilesReadWithDefaults) {
  Calibration c = sample_calibration();
  c.version = 1;
  const std::string v1 = calibration_json(c);
  EXPECT_EQ(v1.find("recompute"), std::string::npos);
  EXPECT_EQ(v1.find("graph"), std::string::npos);
  const Calibration back = parse_calibration(v1, "old.json");
  EXPECT_EQ(back.version, 1);
  const KernelRates k = back.models[0].rates();
  EXPECT_DOUBLE_EQ(k.recompute, 4.0 / 3.0);
  EXPECT_EQ(k.graph_block, 1.0);
  EXPECT_EQ(k.graph_optimizer, 1.0);
  EXPECT_EQ(back.bus->overlap_slowdown, 0.0);  // not written in version 1: unmeasured
  std::string v3 = calibration_json(sample_calibration());
  v3.replace(v3.find("\"version\": 2"), 12, "\"version\": 3");
  EXPECT_TRUE(test::throws_naming([&] { parse_calibration(v3, "new.json"); }, {"new.json", "version 3"}));
  // A version 2 file without its recompute timing is refused, naming it.
  std::string no_recompute = calibration_json(sample_calibration());
  no_recompute.replace(no_recompute.find("\"recompute\""), 11, "\"recompuTe\"");
  EXPECT_TRUE(test::throws_naming([&] { parse_calibration(no_recompute, "f.json"); }, {"f.json", "recompute"}));
}

TEST(PlanCalibration, CorruptFilesAreRefusedNamingWhy) {
  EXPECT_TRUE(test::throws_naming([] { parse_calibration("{not json", "f.json"); }, {"f.json", "not JSON"}));
  EXPECT_TRUE(test::throws_naming([] { parse_calibration("{\"a\": 1}", "f.json"); }, {"f.json", "format"}));
  std::string s = calibration_json(sample_calibration());
  std::string negative = s;
  negative.replace(negative.find("\"rate\": 500000000000000.0"), 25, "\"rate\": -1.0");
  EXPECT_TRUE(test::throws_naming([&] { parse_calibration(negative, "f.json"); }, {"f.json", "gemm", "rate"}));
  std::string missing = s;
  missing.replace(missing.find("\"models\""), 8, "\"modelz\"");
  EXPECT_TRUE(test::throws_naming([&] { parse_calibration(missing, "f.json"); }, {"f.json", "models"}));
  EXPECT_THROW(read_calibration("/nonexistent/dir/cal.json"), Error);
}

}  // namespace plan_cost_model_test
