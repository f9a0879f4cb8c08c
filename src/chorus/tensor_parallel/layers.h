// Megatron-LM's tensor-parallel layers (Shoeybi et al. 2019; sequence
// parallelism: Korthikanti et al. 2022), composed from the conjugate
// functions of mappings.h:
//
//   ColumnParallelLinear  weight [out/tp, in]: y_r = x W_r^T + b_r, the output
//                         split over the ranks (input: f = copy_to_tp, or
//                         with sequence parallelism the all-gather of the
//                         sequence chunks, rank-major)
//   RowParallelLinear     weight [out, in/tp]: y = sum_r x_r W_r^T + b (g =
//                         reduce_from_tp, or with sequence parallelism the
//                         reduce-scatter to sequence chunks, from rank-major
//                         input), bias replicated
//   VocabParallelEmbedding  weight [num/tp, dim]: each rank looks up the ids in
//                         its rows (zeros elsewhere), then g (or reduce-scatter)
//   ParallelLayerNorm     a LayerNorm on sequence chunks when sequence
//                         parallel (its replicated weight's gradient summed
//                         over the ranks, which each saw part of the sequence)
//
// A column-parallel layer followed by a row-parallel one (attention's QKV and
// output projection, the MLP's two matrices) communicates once in forward
// and once in backward. Parameters keep nn::Linear's / nn::Embedding's names
// (weight, bias), so state dicts at tp=1 and tp=N name the same tensors.
//
// Note [Rank-major activations]: under sequence parallelism a rank holds
// [B, T/tp, C], its chunk of the sequence. The all-gather into a parallel
// region concatenates the ranks' flat buffers, which is [tp * B, T/tp, C]
// with rank r's chunk at rows r*B..; putting that into sequence order
// [B, T, C] (and the reduce-scatter's input back out of it) took a transposing
// copy of the whole activation on each side of every collective, four per
// block forward and four backward. The parallel regions keep the rank-major
// order instead: a linear layer, GELU and dropout work on each token alone
// and do not care in which order the tokens come, so the MLP runs on it as
// it is, and only attention, which mixes the tokens of a sequence, moves its
// input and output into sequence order (rank_major_to_sequence and back:
// tensors of 3C/tp and C/tp features, not C).
// With the collectives in K chunks (TPContext::chunks, Note [Chunked
// collectives beside the products] in sp_linear.h) each all-gather lands
// one chunk of every rank, so the region's rows are chunk-major over
// rank-major blocks, [K][tp][B T/tp / K] (chunks.h); the row-parallel side
// reduce-scatters the same blocks back, and attention's conversion takes K:
// when K divides B (every chunk whole sequences) it is still one
// transposing copy, [K][tp][B/K][T/tp] -> [K][B/K][tp][T/tp]; otherwise it
// goes through rank-major order (two). The shape stays [tp * B, T/tp, F].
//
// Note [Replicated parameters under sequence parallelism]: a parameter every
// rank holds whole (LayerNorm's, a row-parallel bias, the positional
// embedding) but applies to its own chunk of the sequence gets a partial
// gradient on each rank; it is used through copy_to_tp, whose backward sums
// the ranks' parts, so every rank ends the backward with the full gradient
// and no step after it is needed (Megatron instead all-reduces these
// gradients after the backward).
#pragma once

#include <memory>

#include "chorus/core/rng.h"
#include "chorus/distributed/process_group.h"
#include "chorus/nn/module.h"
#include "chorus/tensor_parallel/shard.h"

namespace chorus::tp {

// What every tensor-parallel layer of a model shares.
struct TPContext {
  dist::ProcessGroupPtr group;      // the tensor-parallel group; null or one rank: tp=1
  bool sequence_parallel = false;   // activations outside the parallel regions sharded along dim 1 (sequence)
  // Sequence parallel: the chunks each rank's tokens are split into so that
  // the collectives of a parallel region run beside its products (Note
  // [Chunked collectives beside the products] in sp_linear.h; `--tp-chunks`).
  // 1: one collective per op. One that does not divide a step's tokens per
  // rank falls back to 1 for that step (effective_chunks in chunks.h).
  int chunks = 1;
  // The generator of dropout on activations that differ across the tensor
  // ranks (a rank's heads, its sequence chunk): seeded per (data, tensor)
  // rank, see seed_parallel_rng. Null: the default generator.
  std::shared_ptr<Generator> sharded_rng;
  int size() const { return group ? group->size() : 1; }
  int rank() const { return group ? group->rank() : 0; }
};

// Note [Dropout across the mesh]: seeds the default generator with `seed`
// mixed with the data-parallel rank `dp_rank` -- dropout on replicated
// activations must draw the same masks on the tensor ranks of one data rank
// (or the copies of the residual stream drift apart) and different ones
// across data ranks -- and ctx.sharded_rng (created when null) with `seed`
// mixed with both ranks, for activations that differ across tensor ranks.
// Call it after building the model (whose initial weights every rank draws
// alike from one seed). dp_rank 0 sets the default generator to `seed` itself.
void seed_parallel_rng(TPContext& ctx, uint64_t seed, int dp_rank);

// Where a layer's weights come from: nn::Linear's (or nn::Embedding's)
// initialisation of the full tensor, then this rank's slice (the same values
// as at tp=1 given the same seed, drawn on every rank), or zeros for a model
// that loads its weights itself (no random numbers drawn).
enum class Init { Full, Zeros };

struct ParallelLinearOptions {
  int64_t in, out;
  bool bias = true;
  int64_t blocks = 1;  // Note [Blocked shards] (column-parallel only)
  Init init = Init::Full;
};

class ColumnParallelLinear : public nn::Module, public ShardedModule {
 public:
  ColumnParallelLinear(ParallelLinearOptions o, TPContext ctx);
  // x [..., in] (sequence parallel: [B, T/tp, in]) -> [..., out/tp] (sequence
  // parallel: [tp * B, T/tp, out/tp], rank-major: Note [Rank-major activations])
  Tensor forward(const Tensor& x) override;
  ShardSpec shard_spec(const std::string& param) const override;
  std::string extra_repr() const override;

 protected:
  std::shared_ptr<nn::Module> make_empty() const override;

 private:
  ParallelLinearOptions opts_;
  TPContext ctx_;
};

class RowParallelLinear : public nn::Module, public ShardedModule {
 public:
  RowParallelLinear(ParallelLinearOptions o, TPContext ctx);
  // x [..., in/tp] -> [..., out] summed over the ranks (sequence parallel:
  // rank-major [tp * B, T/tp, in/tp] -> [B, T/tp, out], this rank's sequence chunk)
  Tensor forward(const Tensor& x) override;
  ShardSpec shard_spec(const std::string& param) const override;
  std::string extra_repr() const override;

 protected:
  std::shared_ptr<nn::Module> make_empty() const override;

 private:
  ParallelLinearOptions opts_;
  TPContext ctx_;
};

struct VocabParallelEmbeddingOptions {
  int64_t num, dim;
  Init init = Init::Full;
};
class VocabParallelEmbedding : public nn::Module, public ShardedModule {
 public:
  VocabParallelEmbedding(VocabParallelEmbeddingOptions o, TPContext ctx);
  // ids [B, T] (the same on every rank) -> [B, T, dim] (sequence parallel: [B, T/tp, dim])
  Tensor forward(const Tensor& ids) override;
  ShardSpec shard_spec(const std::string& param) const override;
  Tensor& weight() { return own_parameters()[0].second; }
  int64_t rows_per_rank() const { return opts_.num / ctx_.size(); }
  std::string extra_repr() const override;

 protected:
  std::shared_ptr<nn::Module> make_empty() const override;

 private:
  VocabParallelEmbeddingOptions opts_;
  TPContext ctx_;
};

class ParallelLayerNorm : public nn::Module {
 public:
  ParallelLayerNorm(int64_t dim, TPContext ctx, double eps = 1e-5);
  Tensor forward(const Tensor& x) override;
  std::string extra_repr() const override;

 protected:
  std::shared_ptr<nn::Module> make_empty() const override;

 private:
  int64_t dim_;
  TPContext ctx_;
  double eps_;
};

// Between the rank-major order of a parallel region under sequence
// parallelism ([tp * B, T/tp, F]; chunk-major over it for chunks > 1) and
// sequence order ([B, T, F]), with autograd; the identity at tp=1 (Note
// [Rank-major activations]).
Tensor rank_major_to_sequence(const Tensor& x, int tp, int chunks = 1);
Tensor sequence_to_rank_major(const Tensor& x, int tp, int chunks = 1);

// A replicated parameter as a layer applying it should see it: itself, or
// under sequence parallelism through copy_to_tp (Note [Replicated parameters
// under sequence parallelism]).
Tensor replicated_param(const Tensor& p, const TPContext& ctx);

// Dropout on an activation; `sharded`: one that differs across the tensor
// ranks (drawn from ctx.sharded_rng).
Tensor parallel_dropout(const Tensor& x, double p, bool training, bool sharded, const TPContext& ctx);

}  // namespace chorus::tp
