// models::gpt_activation_bytes (Note [GPT activation count]) against what a
// small GPT's training step really holds on the CPU, whose allocator counts
// the bytes in use and their peak like the CUDA one: the peak above the
// weights over a forward, the loss and the backward, with the gradients
// already allocated (as DDP's buckets are), within 10% of the formula.
#include <gtest/gtest.h>

#include <cstdio>

#include <chorus/chorus.h>
#include <chorus/models/gpt_memory.h>

namespace chorus::gpt_memory_test {  // named: the unity build puts test files side by side

using models::GPT;
using models::GPTConfig;

GPTConfig small(bool recompute, int64_t blocks = -1) {
  GPTConfig c;
  c.layers = 3;
  c.heads = 4;
  c.width = 128;
  c.vocab = 500;
  c.padded_vocab = 512;
  c.context = 64;
  c.recompute_blocks = recompute ? (blocks < 0 ? c.layers : blocks) : 0;
  return c;
}

// The peak bytes above what was in use before, over one forward and backward
// of `batch` x `seq` tokens, every gradient allocated beforehand.
int64_t measured_step(GPT& model, int64_t batch, int64_t seq) {
  const Device cpu = cpu_device(0);
  {
    // A first step allocates the gradients; the measured one accumulates into them.
    Tensor ids = randint(0, model.config().vocab, {batch, seq}), tg = randint(0, model.config().vocab, {batch, seq});
    model.loss(ids, tg).backward();
  }
  const int64_t before = static_cast<int64_t>(backend(cpu).bytes_in_use(cpu));
  backend(cpu).reset_peak_bytes(cpu);
  {
    Tensor ids = randint(0, model.config().vocab, {batch, seq}), tg = randint(0, model.config().vocab, {batch, seq});
    model.loss(ids, tg).backward();
  }
  return static_cast<int64_t>(backend(cpu).peak_bytes(cpu)) - before;
}

void expect_within_10_percent(const GPTConfig& cfg, int64_t batch, int64_t seq) {
  manual_seed(1);
  GPT model(cfg);
  const int64_t measured = measured_step(model, batch, seq);
  const int64_t planned = models::gpt_activation_bytes(cfg, batch, seq, /*bf16=*/false, /*fused=*/false).total();
  EXPECT_NEAR(static_cast<double>(measured), static_cast<double>(planned), 0.10 * static_cast<double>(planned))
      << "measured " << measured << " bytes, planned " << planned;
  std::printf("activations of %lld x %lld tokens%s: measured %lld bytes, planned %lld (%.1f%%)\n", (long long)batch,
              (long long)seq, cfg.recompute_blocks > 0 ? " (recompute)" : "", (long long)measured, (long long)planned,
              100.0 * static_cast<double>(measured) / static_cast<double>(planned));
}

TEST(GPTMemory, ActivationFormulaMatchesAMeasuredStep) { expect_within_10_percent(small(false), 4, 64); }

TEST(GPTMemory, ActivationFormulaMatchesAMeasuredRecomputedStep) { expect_within_10_percent(small(true), 4, 64); }

// Note [Recomputing some blocks]: the first k of the blocks recompute; the
// formula counts k inputs and L - k whole sets, checked against a step.
TEST(GPTMemory, ActivationFormulaMatchesSomeBlocksRecomputed) {
  GPTConfig c = small(true, 1);
  c.layers = 4;
  expect_within_10_percent(c, 4, 64);
  c.recompute_blocks = 3;
  expect_within_10_percent(c, 4, 64);
  // Between none and every block, one block's set minus its input apart each.
  GPTConfig none = c, all = c;
  none.recompute_blocks = 0;
  all.recompute_blocks = 100;  // clamped to the 4 blocks
  const int64_t a0 = models::gpt_activation_bytes(none, 4, 64, false, false).blocks;
  const int64_t a4 = models::gpt_activation_bytes(all, 4, 64, false, false).blocks;
  const int64_t a3 = models::gpt_activation_bytes(c, 4, 64, false, false).blocks;
  EXPECT_EQ(a0 - a3, 3 * (a0 - a4) / 4);
  EXPECT_TRUE(all.recomputes_every_block());
}

// --recompute-gelu keeps GELU's input only: checked against a measured step,
// alone and with some blocks recomputed.
TEST(GPTMemory, ActivationFormulaMatchesRecomputedGelu) {
  GPTConfig c = small(false);
  c.recompute_gelu = true;
  expect_within_10_percent(c, 4, 64);
  c.layers = 4;
  c.recompute_blocks = 2;
  expect_within_10_percent(c, 4, 64);
  GPTConfig kept = small(false);
  GPTConfig dropped = kept;
  dropped.recompute_gelu = true;
  EXPECT_EQ(models::gpt_activation_bytes(kept, 4, 64, false, false).blocks -
                models::gpt_activation_bytes(dropped, 4, 64, false, false).blocks,
            kept.layers * 4 * (4 * 64) * kept.width * 4);  // 4 N C floats a block
}

TEST(GPTMemory, ActivationFormulaMatchesOtherShapes) {
  GPTConfig c = small(false);
  c.layers = 2;
  c.heads = 2;
  c.width = 64;
  c.vocab = 1000;
  c.padded_vocab = 1024;
  expect_within_10_percent(c, 8, 16);  // the classifier dominates
  c.vocab = 100;
  c.padded_vocab = 128;
  expect_within_10_percent(c, 2, 64);  // the blocks and the attention matrices do
  c.recompute_blocks = c.layers;
  expect_within_10_percent(c, 2, 64);
}

TEST(GPTMemory, RecomputeAndFusedAttentionKeepLess) {
  const GPTConfig g = GPTConfig::named("gpt2");
  const int64_t plain = models::gpt_activation_bytes(g, 8, 1024, true, true).total();
  GPTConfig r = g;
  r.recompute_blocks = r.layers;
  EXPECT_LT(models::gpt_activation_bytes(r, 8, 1024, true, true).total(),
            models::gpt_activation_bytes(g, 8, 1024, true, true).total() / 2);
  EXPECT_LT(plain, models::gpt_activation_bytes(g, 8, 1024, true, false).total());
  // bf16 halves what the blocks keep.
  EXPECT_EQ(2 * models::gpt_activation_bytes(g, 8, 1024, true, false).blocks -
                models::gpt_activation_bytes(g, 8, 1024, false, false).blocks,
            12 * 4 * 8192 * 4);  // the float32 norm statistics do not halve
}

}  // namespace chorus::gpt_memory_test
