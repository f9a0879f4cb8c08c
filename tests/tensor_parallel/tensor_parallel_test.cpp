// Tensor-parallel pieces that need no second rank: the slicing of full
// tensors into shards (Note [Blocked shards]), the vocabulary-parallel cross
// entropy at tp=1 against nn::functional::cross_entropy_fused (values and
// gradients, padding columns and ignore_index), and the tp=1 GPT against
// models::GPT. tp > 1 runs over real processes in tests/distributed/tensor_parallel.sh.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "chorus/autograd/functions.h"
#include "chorus/autograd/grad_mode.h"
#include "chorus/core/error.h"
#include "chorus/core/rng.h"
#include "chorus/nn/functional.h"
#include "chorus/ops/factory.h"
#include "chorus/tensor_parallel/chunks.h"
#include "chorus/tensor_parallel/cross_entropy.h"
#include "chorus/tensor_parallel/gpt.h"
#include "chorus/models/gpt_pipeline.h"
#include "chorus/parallel/placement.h"
#include "chorus/tensor_parallel/gpt_layers.h"
#include "chorus/tensor_parallel/layers.h"
#include "chorus/tensor_parallel/shard.h"

using namespace chorus;

namespace {

double max_abs_diff(const Tensor& a, const Tensor& b) {
  const auto u = a.contiguous().to(kFloat64).to_vector<double>(), v = b.contiguous().to(kFloat64).to_vector<double>();
  EXPECT_EQ(u.size(), v.size());
  double m = 0;
  for (size_t i = 0; i < u.size() && i < v.size(); ++i) m = std::max(m, std::abs(u[i] - v[i]));
  return m;
}

}  // namespace

TEST(TensorParallelShard, PlainRowsAndColumns) {
  Tensor full = arange(0, 24, 1, {kFloat64}).reshape({4, 6});
  // Rows over 2 ranks: rank 1 holds rows 2..3.
  EXPECT_EQ(tp::shard_of(full, {0, 1}, 1, 2).to_vector<double>(), full.narrow(0, 2, 2).contiguous().to_vector<double>());
  // Columns over 3 ranks: rank 2 holds columns 4..5.
  EXPECT_EQ(tp::shard_of(full, {1, 1}, 2, 3).to_vector<double>(), full.narrow(1, 4, 2).contiguous().to_vector<double>());
  // Replicated: a copy of the whole.
  EXPECT_EQ(tp::shard_of(full, {}, 1, 2).to_vector<double>(), full.to_vector<double>());
  EXPECT_THROW(tp::shard_of(full, {0, 1}, 0, 3), ValueError);  // 4 rows over 3 ranks
}

TEST(TensorParallelShard, BlocksSplitEachBlock) {
  // c_attn's layout: q, k, v stacked, 4 rows each. Rank r of 2 holds rows
  // [2r, 2r + 2) of each block, stacked.
  Tensor full = arange(0, 12, 1, {kFloat64}).reshape({12, 1});
  EXPECT_EQ(tp::shard_of(full, {0, 3}, 0, 2).to_vector<double>(), (std::vector<double>{0, 1, 4, 5, 8, 9}));
  EXPECT_EQ(tp::shard_of(full, {0, 3}, 1, 2).to_vector<double>(), (std::vector<double>{2, 3, 6, 7, 10, 11}));
  Tensor bias = arange(0, 12, 1, {kFloat64});
  EXPECT_EQ(tp::shard_of(bias, {0, 3}, 1, 4).to_vector<double>(), (std::vector<double>{1, 5, 9}));
}

TEST(VocabParallelCrossEntropy, EqualsTheFusedLossAtOneRank) {
  manual_seed(7);
  // 6 rows over a vocabulary of 10 in 16 columns (the 6 past it are padding),
  // one target ignored.
  Tensor logits = randn({2, 3, 16}, {kFloat64}).mul(3.0);
  Tensor targets = from_vector(std::vector<int64_t>{0, 9, 4, -1, 7, 3}, {2, 3});
  for (std::optional<int64_t> ignore : {std::optional<int64_t>(), std::optional<int64_t>(-1)}) {
    Tensor tg = ignore ? targets : from_vector(std::vector<int64_t>{0, 9, 4, 2, 7, 3}, {2, 3});
    Tensor a = logits.detach().clone().requires_grad_(), b = logits.detach().clone().requires_grad_();
    Tensor want = nn::functional::cross_entropy_fused(a, tg, 10, ignore);
    Tensor got = tp::vocab_parallel_cross_entropy(b, tg, 10, nullptr, ignore);
    EXPECT_LE(std::abs(got.item() - want.item()), 1e-14 * std::abs(want.item()));
    want.backward();
    got.backward();
    EXPECT_LE(max_abs_diff(b.grad(), a.grad()), 1e-15);
    // Padding columns take no part and get no gradient.
    EXPECT_EQ(max_abs_diff(b.grad().narrow(2, 10, 6), zeros({2, 3, 6}, {kFloat64})), 0.0);
  }
}

TEST(VocabParallelCrossEntropy, RefusesMismatchedShapes) {
  Tensor logits = zeros({2, 3, 8}, {kFloat64});
  EXPECT_THROW(tp::vocab_parallel_cross_entropy(logits, zeros({2, 4}, {kInt64}), 8, nullptr), ValueError);
  EXPECT_THROW(tp::vocab_parallel_cross_entropy(logits, zeros({2, 3}, {kInt64}), 9, nullptr), ValueError);
}

TEST(TensorParallelGPT, OneRankEqualsTheGPT) {
  models::GPTConfig c;
  c.layers = 2;
  c.heads = 2;
  c.width = 16;
  c.vocab = 50;
  c.padded_vocab = 64;
  c.context = 8;
  manual_seed(3);
  models::GPT ref(c);
  ref.to(kFloat64);
  manual_seed(3);
  auto model = std::make_shared<tp::TensorParallelGPT>(c, tp::TPContext{});
  model->to(kFloat64);
  EXPECT_EQ(model->state_dict().size(), ref.state_dict().size());
  manual_seed(5);
  Tensor ids = randint(0, 50, {2, 8}), tg = randint(0, 50, {2, 8});
  Tensor want = ref.loss(ids, tg), got = model->loss(ids, tg);
  EXPECT_LE(std::abs(got.item() - want.item()), 1e-13);
  NoGradGuard no_grad;
  EXPECT_LE(max_abs_diff(model->gather_logits(model->forward(ids)), ref.forward(ids)), 1e-13);
}

TEST(TensorParallelGPT, RefusesATpThatDoesNotDivide) {
  models::GPTConfig c = models::GPTConfig::named("d2");  // 2 heads
  try {
    tp::check_gpt_tp(c, 4);
    FAIL() << "tp=4 with 2 heads was accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("2 attention heads do not divide over 4"), std::string::npos);
  }
  c.heads = 8;
  c.padded_vocab = 100;
  try {
    tp::check_gpt_tp(c, 8);
    FAIL() << "tp=8 with a vocabulary of 100 rows was accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("vocabulary of 100 rows does not divide over 8"), std::string::npos);
  }
  EXPECT_NO_THROW(tp::check_gpt_tp(c, 4));
}

// Note [Chunked collectives beside the products]: with K chunks the row
// (c, r, j) of the region, index (c * tp + r) * m/K + j, is rank r's local
// token i = c * m/K + j, i.e. (b, j') = (i / (T/tp), i % (T/tp)), at
// position r * T/tp + j' of sequence order -- checked row by row against
// that arithmetic for chunks of whole sequences (K divides B), chunks that
// split sequences, and a K that divides no rank's tokens (as K = 1).
TEST(TensorParallelLayout, ChunkMajorIsEachChunkOfEveryRank) {
  manual_seed(5);
  struct Case {
    int tp;
    int64_t b, t;
    int chunks, expect_k;
  };
  for (const Case cs : {Case{2, 4, 8, 2, 2}, Case{2, 2, 8, 4, 4}, Case{3, 2, 6, 4, 4}, Case{4, 3, 8, 3, 3},
                        Case{2, 3, 4, 4, 1}, Case{3, 1, 9, 3, 3}}) {
    SCOPED_TRACE("tp " + std::to_string(cs.tp) + " B " + std::to_string(cs.b) + " T " + std::to_string(cs.t) +
                 " K " + std::to_string(cs.chunks));
    const int64_t f = 3, local_t = cs.t / cs.tp, m = cs.b * local_t;
    ASSERT_EQ(tp::effective_chunks(cs.chunks, m), cs.expect_k);
    const int64_t mc = m / cs.expect_k;
    Tensor seq = randn({cs.b, cs.t, f}, kFloat64);
    Tensor cm = tp::sequence_to_rank_major(seq, cs.tp, cs.chunks);
    ASSERT_EQ(cm.sizes(), (Shape{cs.tp * cs.b, local_t, f}));
    Tensor rows = cm.reshape({cs.tp * m, f});
    for (int c = 0; c < cs.expect_k; ++c)
      for (int r = 0; r < cs.tp; ++r)
        for (int64_t j = 0; j < mc; ++j) {
          const int64_t i = c * mc + j, bb = i / local_t, pos = r * local_t + i % local_t;
          EXPECT_EQ(max_abs_diff(rows.narrow(0, (c * cs.tp + r) * mc + j, 1).reshape({f}),
                                 seq.narrow(0, bb, 1).narrow(1, pos, 1).reshape({f})),
                    0.0);
        }
    EXPECT_EQ(max_abs_diff(tp::rank_major_to_sequence(cm, cs.tp, cs.chunks), seq), 0.0);
    // Chunk-major over rank-major: the same rows as going through rank-major order.
    Tensor rm = tp::sequence_to_rank_major(seq, cs.tp);
    EXPECT_EQ(max_abs_diff(tp::rank_major_to_chunk_major(rm, cs.tp, cs.chunks), cm), 0.0);
    EXPECT_EQ(max_abs_diff(tp::chunk_major_to_rank_major(cm, cs.tp, cs.chunks), rm), 0.0);
    // Gradients: the conversion of the gradient, by the inverse conversion.
    Tensor x = seq.clone().set_requires_grad(true);
    Tensor w = randn(cm.sizes(), kFloat64);
    chorus::sum(chorus::mul(tp::sequence_to_rank_major(x, cs.tp, cs.chunks), w)).backward();
    EXPECT_EQ(max_abs_diff(x.grad(), tp::rank_major_to_sequence(w, cs.tp, cs.chunks)), 0.0);
  }
  EXPECT_THROW(tp::effective_chunks(0, 8), Error);
  EXPECT_THROW(tp::rank_major_to_chunk_major(randn({5, 2}, kFloat64), 2, 2), Error);
}

// Note [Rank-major activations]: rank-major row r*B + b, position j is token
// (b, r*T/tp + j) of sequence order; the two conversions invert each other
// and carry gradients through.
TEST(TensorParallelLayout, RankMajorIsTheRanksChunksStacked) {
  manual_seed(3);
  const int tp = 3;
  const int64_t b = 2, t = 6, f = 4, chunk = t / tp;
  Tensor seq = randn({b, t, f}, kFloat64);
  Tensor rm = tp::sequence_to_rank_major(seq, tp);
  ASSERT_EQ(rm.sizes(), (Shape{tp * b, chunk, f}));
  for (int r = 0; r < tp; ++r)
    for (int64_t bb = 0; bb < b; ++bb)
      EXPECT_EQ(max_abs_diff(rm.narrow(0, r * b + bb, 1).reshape({chunk, f}),
                             seq.narrow(0, bb, 1).narrow(1, r * chunk, chunk).reshape({chunk, f})),
                0.0);
  EXPECT_EQ(max_abs_diff(tp::rank_major_to_sequence(rm, tp), seq), 0.0);
  EXPECT_EQ(tp::sequence_to_rank_major(seq, 1).impl(), seq.impl());
  // Gradients: the conversion of the gradient, by the inverse conversion.
  Tensor x = seq.clone().set_requires_grad(true);
  Tensor w = randn({tp * b, chunk, f}, kFloat64);
  chorus::sum(chorus::mul(tp::sequence_to_rank_major(x, tp), w)).backward();
  EXPECT_EQ(max_abs_diff(x.grad(), tp::rank_major_to_sequence(w, tp)), 0.0);
  EXPECT_THROW(tp::rank_major_to_sequence(randn({5, 2, 2}, kFloat64), tp), Error);
}

// Note [Pipeline stages by cost]: the default split of a GPT's pipeline
// layers evens out their work (the head is 2.5 of gpt2-xl's blocks), not
// their count.
namespace {
double heaviest_stage(const std::vector<double>& costs, const std::vector<int64_t>& balance, int64_t ranks) {
  std::vector<double> per_rank(static_cast<size_t>(ranks), 0.0);
  size_t l = 0;
  for (size_t s = 0; s < balance.size(); ++s)
    for (int64_t i = 0; i < balance[s]; ++i) per_rank[s % static_cast<size_t>(ranks)] += costs[l++];
  EXPECT_EQ(l, costs.size());
  return *std::max_element(per_rank.begin(), per_rank.end());
}
}  // namespace

TEST(TensorParallelPipeline, StagesSplitTheLayersByCost) {
  const models::GPTConfig xl = models::GPTConfig::named("gpt2-xl", 50257, 1024);
  const std::vector<double> costs = models::pipeline_layer_costs(xl, 1024);
  ASSERT_EQ(costs.size(), 50u);
  EXPECT_EQ(costs.front(), 0.0);
  EXPECT_NEAR(costs.back() / costs[1], 2.488, 1e-3);  // the head, in blocks
  // 1F1B at pp=4: 13, 13, 12 blocks (the embeddings on the first), then 10 and the head.
  const std::vector<int64_t> b4 = parallel::balance_ranks(models::pipeline_layer_costs(xl, 1024), 4);
  EXPECT_EQ(b4, (std::vector<int64_t>{14, 13, 12, 11}));
  // An even split by count (13, 13, 12, 12: 11 blocks and the head last) has a heavier slowest stage.
  EXPECT_NEAR(heaviest_stage(costs, b4, 4) / costs[1], 13.0, 1e-9);
  EXPECT_NEAR(heaviest_stage(costs, {13, 13, 12, 12}, 4) / costs[1], 13.488, 1e-3);
  // Interleaved, V=2: 8 stages, each rank's two together no heavier than 1F1B's.
  const std::vector<int64_t> b8 = parallel::balance_ranks(models::pipeline_layer_costs(xl, 1024), 4, 2);
  ASSERT_EQ(b8.size(), 8u);
  EXPECT_EQ(std::accumulate(b8.begin(), b8.end(), int64_t{0}), 50);
  EXPECT_NEAR(heaviest_stage(costs, b8, 4) / costs[1], 13.0, 1e-9);
  EXPECT_NEAR(heaviest_stage(costs, {7, 7, 6, 6, 6, 6, 6, 6}, 4) / costs[1], 13.488, 1e-3);
  // Under the least slowest stage, the most even split: d12's head (5.4
  // blocks at sequences of 64) alone, the blocks 4, 4, 4 (not 5, 5, 2).
  const models::GPTConfig d12 = models::GPTConfig::named("d12", 50257, 1024);
  EXPECT_EQ(parallel::balance_ranks(models::pipeline_layer_costs(d12, 64), 4), (std::vector<int64_t>{5, 4, 4, 1}));
  // A head of 20 blocks (d2's) takes a stage of its own.
  const models::GPTConfig d2 = models::GPTConfig::named("d2", 50257, 1024);
  EXPECT_EQ(parallel::balance_ranks(models::pipeline_layer_costs(d2, 1024), 2), (std::vector<int64_t>{3, 1}));
  EXPECT_EQ(parallel::balance_ranks(models::pipeline_layer_costs(d2, 32), 4), (std::vector<int64_t>{1, 1, 1, 1}));
  EXPECT_EQ(parallel::balance_ranks(models::pipeline_layer_costs(d2, 32), 2, 2), (std::vector<int64_t>{1, 1, 1, 1}));
  EXPECT_THROW(parallel::balance_ranks(models::pipeline_layer_costs(d2, 32), 5), ValueError);
}
