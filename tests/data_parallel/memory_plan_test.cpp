// dist::MemoryPlan against hand-computed closed forms (Note [Memory plan
// formulas]): GPT-2 124M and GPT-2 XL under ddp and each ZeRO stage over 4
// ranks, the suggestion when a layout does not fit, and the printed forms.
// The parameter counts are worked out by hand below, independently of
// GPTConfig::num_parameters (which the first test checks against them).
#include <gtest/gtest.h>

#include <cstdio>

#include "chorus/core/error.h"
#include "chorus/data_parallel/memory_plan.h"
#include "chorus/models/gpt.h"
#include "chorus/models/gpt_memory.h"
#include "testing/expect_error.h"

using namespace chorus;
using namespace chorus::dist;

// Named, not anonymous: the unity build puts test files side by side.
namespace memory_plan_test {

constexpr int64_t kGiB = int64_t{1} << 30;
constexpr int64_t kMiB = int64_t{1} << 20;

// GPT-2 124M: C = 768, 12 blocks of 12 C^2 + 13 C = 7,087,872; the tied
// embedding 50304 x 768 = 38,633,472; positions 1024 x 768 = 786,432; ln_f 2 C.
constexpr int64_t kGpt2P = 124'475'904, kGpt2Block = 7'087'872, kGpt2Root = 38'633'472 + 786'432 + 1'536;
// Autocast copies: everything but the positions and the norms (12 x 4 C + 2 C).
constexpr int64_t kGpt2Copied = kGpt2P - 786'432 - 12 * 3'072 - 1'536;  // 123,651,072
// GPT-2 XL: C = 1600, 48 blocks of 30,740,800; 50304 x 1600 = 80,486,400;
// 1024 x 1600 = 1,638,400; ln_f 3,200.
constexpr int64_t kXlP = 1'557'686'400, kXlBlock = 30'740'800, kXlRoot = 80'486'400 + 1'638'400 + 3'200;

MemoryPlanInputs inputs(int64_t p, int64_t copied, int64_t unit, int64_t root, bool bf16, int64_t act) {
  MemoryPlanInputs in;
  in.params = p;
  in.autocast_copied = copied;
  in.largest_unit_params = unit;
  in.root_unit_params = root;
  in.bf16 = bf16;
  in.activation_bytes = act;
  return in;
}


TEST(MemoryPlan, GptCountsMatchTheHandCounts) {
  const auto g = models::GPTConfig::named("gpt2");
  EXPECT_EQ(g.num_parameters(), kGpt2P);
  EXPECT_EQ(models::gpt_block_parameters(g), kGpt2Block);
  EXPECT_EQ(models::gpt_root_parameters(g), kGpt2Root);
  EXPECT_EQ(models::gpt_autocast_copied_parameters(g), 123'651'072);
  EXPECT_EQ(kGpt2Copied, 123'651'072);
  const auto xl = models::GPTConfig::named("gpt2-xl");
  EXPECT_EQ(xl.num_parameters(), kXlP);
  EXPECT_EQ(models::gpt_block_parameters(xl), kXlBlock);
  EXPECT_EQ(models::gpt_root_parameters(xl), kXlRoot);
}

TEST(MemoryPlan, Gpt2Fp32OverFourRanks) {
  const int64_t act = 3 * kGiB, k = 25 * kMiB, p = kGpt2P;
  const MemoryPlanInputs in = inputs(p, kGpt2Copied, kGpt2Block, kGpt2Root, false, act);
  const MemoryPlan ddp = plan_for({"ddp", 0, 4}, in);
  EXPECT_EQ(ddp.weights, 497'903'616);  // 4P, no copies in float32
  EXPECT_EQ(ddp.gradients, 497'903'616);
  EXPECT_EQ(ddp.optimizer, 995'807'232);  // 8P
  EXPECT_EQ(ddp.communication, k);
  EXPECT_EQ(ddp.total(), 4 * p + 4 * p + 8 * p + k + act);

  const MemoryPlan z1 = plan_for({"zero", 1, 4}, in);
  EXPECT_EQ(z1.weights, 4 * p);
  EXPECT_EQ(z1.gradients, 4 * p);  // reduced in place: the shards are the buffers' segments
  EXPECT_EQ(z1.optimizer, 248'951'808);  // 8P/4

  const MemoryPlan z2 = plan_for({"zero", 2, 4}, in);
  EXPECT_EQ(z2.weights, 4 * p);
  // 2 x 25 MiB; the shards (4P/4 = 124,475,904) are made in the backward,
  // less than the 3 GiB of activations they follow.
  EXPECT_EQ(z2.gradients, 52'428'800);
  EXPECT_EQ(z2.optimizer, 248'951'808);

  const MemoryPlan z3 = plan_for({"zero", 3, 4}, in);
  // P masters' shard, plus two blocks and the root gathered in float32.
  EXPECT_EQ(z3.weights, 124'475'904 + 4 * (2 * kGpt2Block + kGpt2Root));
  EXPECT_EQ(z3.weights, 338'864'640);
  EXPECT_EQ(z3.gradients, 4 * (2 * kGpt2Block + kGpt2Root));
  EXPECT_EQ(z3.gradients, 214'388'736);
  EXPECT_EQ(z3.optimizer, 248'951'808);
  // Over only 4 ranks in float32, stage 3 saves on the weights but not
  // overall: the gathered root unit (the 38.6M-row tied embedding, weights
  // and gradients) costs more than stage 2's sharded masters save.
  EXPECT_LT(z3.weights, z2.weights);
  EXPECT_GT(z3.total(), z2.total());
  EXPECT_LT(z2.total(), z1.total());
  EXPECT_LT(z1.total(), ddp.total());
}

TEST(MemoryPlan, Gpt2XlBf16OverFourRanks) {
  const int64_t p = kXlP, copied = models::gpt_autocast_copied_parameters(models::GPTConfig::named("gpt2-xl"));
  // Everything but the positions and the norms (48 x 4 C + 2 C).
  EXPECT_EQ(copied, p - 1'638'400 - 48 * 6'400 - 3'200);
  const MemoryPlanInputs in = inputs(p, copied, kXlBlock, kXlRoot, true, 0);
  const MemoryPlan ddp = plan_for({"ddp", 0, 4}, in);
  EXPECT_EQ(ddp.weights, 4 * p + 2 * copied);  // masters and their bf16 copies
  EXPECT_EQ(ddp.gradients, 6'230'745'600);
  EXPECT_EQ(ddp.optimizer, 12'461'491'200);
  const MemoryPlan z1 = plan_for({"zero", 1, 4}, in);
  EXPECT_EQ(z1.weights, ddp.weights);
  EXPECT_EQ(z1.gradients, 6'230'745'600);  // float32 buffers reduced in place
  EXPECT_EQ(z1.optimizer, 3'115'372'800);
  const MemoryPlan z2 = plan_for({"zero", 2, 4}, in);
  // No activations given (0 here): the shards count whole.
  EXPECT_EQ(z2.gradients, 50 * kMiB + 1'557'686'400);
  const MemoryPlan z3 = plan_for({"zero", 3, 4}, in);
  // Gathers in float32: 4 x (2 x 30,740,800 + 82,128,000) = 574,438,400;
  // under bf16 the graph keeps each matrix's per-use cast for the step.
  EXPECT_EQ(z3.weights, 1'557'686'400 + 574'438'400 + 2 * copied);
  EXPECT_EQ(z3.gradients, 1'557'686'400 + 574'438'400);
  EXPECT_EQ(z3.optimizer, 3'115'372'800);
  // --recompute always: only the casts of the two units in flight and the
  // root's, 2 x (2 x 30,740,800 + 82,128,000) = 287,219,200; the other
  // layouts keep their casts between steps whatever recomputes.
  MemoryPlanInputs rec = in;
  rec.recompute = true;
  EXPECT_EQ(plan_for({"zero", 3, 4}, rec).weights, int64_t{1'557'686'400} + 574'438'400 + 287'219'200);
  EXPECT_EQ(plan_for({"zero", 1, 4}, rec).weights, z1.weights);
  EXPECT_EQ(plan_for({"ddp", 0, 4}, rec).weights, ddp.weights);

  // ShardOptions::param_dtype (chorus train's default under bf16): the 48
  // blocks' matrices, 12 x 1600^2 = 30,720,000 each, held in bfloat16 while
  // gathered over float32 masters; only the tied embedding keeps a copy.
  MemoryPlanInputs lp = in;
  lp.low_precision_unit_params = 30'720'000;
  lp.low_precision_params = 48 * lp.low_precision_unit_params;  // 1,474,560,000
  // 4 x 83,126,400 float32 + 2 x 1,474,560,000 bfloat16 full weights, the
  // bf16 weights' masters 1,474,560,000 / 4 x 4, the embedding's copy 2 x 81,177,600.
  const MemoryPlan l1 = plan_for({"zero", 1, 4}, lp);
  EXPECT_EQ(l1.weights, int64_t{332'505'600} + 2'949'120'000 + 1'474'560'000 + 162'355'200);
  // The full buffers only: the float32 buffers' shards are their own
  // segments, the bfloat16 ones' float32 shards are cast into their buffers.
  EXPECT_EQ(l1.gradients, int64_t{332'505'600} + 2'949'120'000);
  EXPECT_EQ(l1.optimizer, z1.optimizer);
  // Stage 3: two units of 20,800 float32 and 30,720,000 bfloat16 elements and
  // the 82,128,000-element float32 root gathered.
  const MemoryPlan l3 = plan_for({"zero", 3, 4}, lp);
  EXPECT_EQ(l3.weights, int64_t{1'557'686'400} + 451'558'400 + 162'355'200);
  EXPECT_EQ(l3.gradients, int64_t{1'557'686'400} + 451'558'400);
  EXPECT_EQ(plan_for({"ddp", 0, 4}, lp).weights, ddp.weights);  // DDP keeps float32 weights
}

// Note [Sharded gradient shards]: gpt2-xl ZeRO-1 with bfloat16 matrices, 8
// sequences of 1024 a GPU (the run measured beside llm.c). On 4 ranks the
// float32 gradient shards of the matrices are cast into their bfloat16
// buffers: nothing beside them, where a persistent float32 shard of every
// parameter took 4P/4 = 1,557,686,400 bytes. On 2 ranks they do not fit
// there and are made after the backward: they count past the activations.
TEST(MemoryPlan, Gpt2XlZero1GradientShards) {
  const auto cfg = models::GPTConfig::named("gpt2-xl");
  const int64_t act = models::gpt_activation_bytes(cfg, 8, 1024, true, true).total();
  MemoryPlanInputs in = inputs(kXlP, models::gpt_autocast_copied_parameters(cfg), kXlBlock, kXlRoot, true, act);
  in.low_precision_unit_params = 30'720'000;
  in.low_precision_params = 48 * in.low_precision_unit_params;  // 1,474,560,000
  const MemoryPlan z1 = plan_for({"zero", 1, 4}, in);
  EXPECT_EQ(z1.gradients, int64_t{332'505'600} + 2'949'120'000);  // the full buffers only
  EXPECT_EQ(z1.total(), z1.weights + z1.gradients + z1.optimizer + 25 * kMiB + act);
  std::printf("gpt2-xl zero-1, bf16 matrices, 4 ranks, batch 8: %s\n", z1.breakdown().c_str());
  std::printf("  total %s GiB (with a persistent float32 shard: %s GiB)\n", gib(z1.total()).c_str(),
              gib(z1.total() + 1'557'686'400).c_str());
  // Activations of 1 GiB change nothing on 4 ranks; on 2 the float32 shards
  // (1,474,560,000 / 2 x 4) count past them.
  in.activation_bytes = kGiB;
  EXPECT_EQ(plan_for({"zero", 1, 4}, in).gradients, z1.gradients);
  EXPECT_EQ(plan_for({"zero", 1, 2}, in).gradients, z1.gradients + 2'949'120'000 - kGiB);
  in.activation_bytes = act;
  EXPECT_GT(act, 2'949'120'000);
  EXPECT_EQ(plan_for({"zero", 1, 2}, in).gradients, z1.gradients);
  // Stages 2 and 3 likewise: their shards (4P/4) are made in the backward.
  EXPECT_EQ(plan_for({"zero", 2, 4}, in).gradients, 50 * kMiB);
  in.activation_bytes = kGiB;
  EXPECT_EQ(plan_for({"zero", 2, 4}, in).gradients, 50 * kMiB + 1'557'686'400 - kGiB);
}

// The target: d84 (~9.7B parameters) in bf16 on 8 GPUs with 79 GiB
// free each -- DDP and ZeRO-1 must stop at once, even at one sequence of 1024
// tokens per GPU with fused attention; a deeper stage fits.
TEST(MemoryPlan, D84RefusesDdpAndZero1OnEightH100s) {
  const auto cfg = models::GPTConfig::named("d84");
  EXPECT_GT(cfg.num_parameters(), 9'600'000'000);
  MemoryPlanInputs in = inputs(cfg.num_parameters(), models::gpt_autocast_copied_parameters(cfg),
                               models::gpt_block_parameters(cfg), models::gpt_root_parameters(cfg), true,
                               models::gpt_activation_bytes(cfg, 1, 1024, true, true).total());
  const int64_t free = 79 * kGiB;
  const MemoryPlan ddp = plan_for({"ddp", 0, 8}, in), z1 = plan_for({"zero", 1, 8}, in);
  EXPECT_FALSE(ddp.fits(free)) << ddp.str(free);
  EXPECT_FALSE(z1.fits(free)) << z1.str(free);
  // 4P + 2Pc + 4P + 8P: about 18 bytes a parameter, 163 GiB before activations.
  EXPECT_GT(ddp.total(), 160 * kGiB);
  auto s = suggest(ddp, in, free);
  ASSERT_TRUE(s.has_value());
  EXPECT_GE(s->strategy.zero_stage, 2);
  EXPECT_TRUE(plan_for({"zero", 3, 8}, in).fits(free));
  std::printf("%s\n", refusal_message("d84", ddp, "cuda:0", free, s).c_str());
  std::printf("%s\n", refusal_message("d84", z1, "cuda:0", free, suggest(z1, in, free)).c_str());
}

TEST(MemoryPlan, SingleAndDataParallelHoldEverything) {
  const MemoryPlanInputs in = inputs(1000, 800, 100, 200, true, 5000);
  const MemoryPlan single = plan_for({"single", 0, 1}, in);
  EXPECT_EQ(single.weights, 4000 + 1600);
  // Made as the activations go and dropped after the step: only the 4000
  // bytes past the 5000 of activations would count, none here.
  EXPECT_EQ(single.gradients, 0);
  EXPECT_EQ(single.optimizer, 8000);
  EXPECT_EQ(single.communication, 0);
  EXPECT_EQ(single.total(), 5600 + 8000 + 5000);
  MemoryPlanInputs small = in;
  small.activation_bytes = 1500;
  EXPECT_EQ(plan_for({"single", 0, 1}, small).gradients, 4000 - 1500);
  MemoryPlanInputs accum = in;
  accum.micro_batches = 2;  // the first micro-batch's gradients live through the second's forward
  EXPECT_EQ(plan_for({"single", 0, 1}, accum).gradients, 4000);
  MemoryPlanInputs unknown = in;
  unknown.activation_bytes.reset();  // measured on the first step: the whole gradients
  EXPECT_EQ(plan_for({"single", 0, 1}, unknown).gradients, 4000);
  const MemoryPlan dp = plan_for({"dp", 0, 2}, in);
  EXPECT_EQ(dp.weights, single.weights);
  EXPECT_EQ(dp.gradients, 4000);  // DataParallel and DDP keep theirs (DDP: its buckets)
  EXPECT_EQ(plan_for({"ddp", 0, 2}, in).gradients, 4000);
  EXPECT_EQ(dp.communication, 25 * kMiB);
  // Uneven shards round up: 1001 parameters over 4 ranks hold 251 each.
  MemoryPlanInputs odd = in;
  odd.params = 1001;
  EXPECT_EQ(plan_for({"zero", 1, 4}, odd).optimizer, 8 * 251);
}

TEST(MemoryPlan, RefusesUnknownLayouts) {
  const MemoryPlanInputs in = inputs(10, 0, 1, 1, false, 0);
  EXPECT_TRUE(test::throws_naming([&] { plan_for({"zero", 4, 2}, in); }, {"--zero-stage must be 1, 2 or 3"}));
  EXPECT_TRUE(test::throws_naming([&] { plan_for({"fsdp", 0, 2}, in); }, {"unknown strategy 'fsdp'"}));
  EXPECT_TRUE(test::throws_naming([&] { plan_for({"ddp", 0, 0}, in); }, {"at least 1"}));
}

TEST(MemoryPlan, ReserveAndFit) {
  MemoryPlan m;
  m.weights = 10 * kGiB;
  m.activations = 10 * kGiB;
  EXPECT_EQ(m.total(), 20 * kGiB);
  EXPECT_EQ(m.needed(), 20 * kGiB + kGiB + 512 * kMiB);  // 5% and 512 MiB
  EXPECT_TRUE(m.fits(m.needed()));
  EXPECT_FALSE(m.fits(m.needed() - 1));
}

TEST(MemoryPlan, SuggestsTheCheapestLayoutThatFits) {
  // gpt2-xl in bf16 with 20 GiB of activations over 4 ranks.
  const int64_t copied = models::gpt_autocast_copied_parameters(models::GPTConfig::named("gpt2-xl"));
  const MemoryPlanInputs in = inputs(kXlP, copied, kXlBlock, kXlRoot, true, 20 * kGiB);
  const MemoryPlan ddp = plan_for({"ddp", 0, 4}, in);
  const MemoryPlan z1 = plan_for({"zero", 1, 4}, in), z2 = plan_for({"zero", 2, 4}, in), z3 = plan_for({"zero", 3, 4}, in);
  // Room for ddp: nothing to suggest.
  EXPECT_FALSE(suggest(ddp, in, ddp.needed()).has_value());
  // Room for zero 1 only just: zero 1, not the deeper stages.
  auto s = suggest(ddp, in, z1.needed());
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->strategy.flags(), "--strategy zero --zero-stage 1");
  EXPECT_EQ(s->strategy.world, 4);
  s = suggest(ddp, in, z2.needed());
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->strategy.zero_stage, 2);
  s = suggest(ddp, in, z3.needed());
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->strategy.zero_stage, 3);
  // Not even zero 3: none.
  EXPECT_FALSE(suggest(ddp, in, z3.needed() - 1).has_value());
  // Only the layouts offered.
  EXPECT_FALSE(suggest(ddp, in, z3.needed(), std::vector<MemoryStrategy>{{"ddp", 0, 4}}).has_value());
}

TEST(MemoryPlan, PrintsATableAndOneLineRefusal) {
  MemoryPlan m;
  m.strategy = {"ddp", 0, 8};
  m.weights = 6 * kGiB + kGiB / 2;  // 6.5
  m.gradients = 6 * kGiB;
  m.optimizer = 12 * kGiB;
  m.communication = 25 * kMiB;
  m.activations = 28 * kGiB;
  const std::string t = m.str(79 * kGiB);
  EXPECT_NE(t.find("memory plan per GPU (--strategy ddp, 8 ranks):\n"), std::string::npos) << t;
  EXPECT_NE(t.find("  weights             6.50 GiB\n"), std::string::npos) << t;
  EXPECT_NE(t.find("  communication       0.02 GiB\n"), std::string::npos) << t;
  EXPECT_NE(t.find("  activations         28.0 GiB\n"), std::string::npos) << t;
  EXPECT_NE(t.find("  total               52.5 GiB\n"), std::string::npos) << t;
  EXPECT_NE(t.find("  free                79.0 GiB"), std::string::npos) << t;
  EXPECT_EQ(t.back(), 'B');  // no trailing newline: the caller adds it

  MemoryPlan z3 = m;
  z3.strategy = {"zero", 3, 8};
  z3.weights = z3.gradients = z3.optimizer = kGiB;
  z3.activations = 5 * kGiB;
  // needed: 52.52 GiB x 1.05 + 0.5 = 55.65; zero 3: 8.02 x 1.05 + 0.5 = 8.93.
  const std::string r = refusal_message("gpt2-xl", m, "cuda:0", 40 * kGiB, z3);
  EXPECT_EQ(r, "gpt2-xl with --strategy ddp needs 55.7 GiB per GPU (weights 6.50, gradients 6.00, optimizer 12.0, "
               "communication 0.02, activations 28.0, reserve 3.13), cuda:0 has 40.0 GiB free; with --strategy zero "
               "--zero-stage 3 it would need 8.93 GiB (--ignore-memory-plan runs anyway)");
  EXPECT_NE(refusal_message("d84", m, "cuda:0", kGiB, std::nullopt).find("no data-parallel layout over 8 GPU(s) fits"),
            std::string::npos);
  EXPECT_EQ(r.find('\n'), std::string::npos);
}

TEST(MemoryPlan, MeasuredLine) {
  MemoryPlan m;
  m.weights = 4 * kGiB;
  m.activations = 6 * kGiB;
  EXPECT_EQ(measured_line(m, 9 * kGiB + kGiB / 2), "memory: peak 9.50 GiB measured, plan 10.0 GiB (95%)");
  m.activations.reset();
  EXPECT_EQ(measured_line(m, 9 * kGiB), "memory: peak 9.00 GiB measured, 4.00 GiB before the activations; "
                                        "activations and workspaces 5.00 GiB (measured on the first step)");
  EXPECT_NE(m.str().find("activations     measured on the first step"), std::string::npos) << m.str();
}

}  // namespace memory_plan_test
