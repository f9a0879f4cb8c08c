#include "chorus/tensor_parallel/layers.h"

#include "chorus/autograd/functions.h"
#include "chorus/autograd/grad_mode.h"
#include "chorus/core/error.h"
#include "chorus/nn/functional.h"
#include "chorus/nn/layers.h"
#include "chorus/nn/transformer_layers.h"
#include "chorus/ops/factory.h"
#include "chorus/tensor_parallel/chunks.h"
#include "chorus/tensor_parallel/mappings.h"
#include "chorus/tensor_parallel/sp_linear.h"

namespace chorus::tp {

namespace F = nn::functional;

namespace {

void check_divides(int64_t n, const TPContext& ctx, const char* layer, const char* what) {
  CHORUS_CHECK(n % ctx.size() == 0, layer, ": ", what, " ", n, " does not divide over tp=", ctx.size());
}

// The sequence chunks along dim 1 that sequence parallelism shards.
constexpr int64_t kSeqDim = 1;
// Inside a parallel region under sequence parallelism: the ranks' chunks
// stacked along dim 0 (Note [Rank-major activations]).
constexpr int64_t kRankMajorDim = 0;

}  // namespace

void seed_parallel_rng(TPContext& ctx, uint64_t seed, int dp_rank) {
  // splitmix64-style mixing: distinct (dp, tp) give unrelated seeds.
  auto mix = [](uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
  };
  manual_seed(dp_rank == 0 ? seed : mix(seed ^ mix(static_cast<uint64_t>(dp_rank))));
  const uint64_t ranks = (static_cast<uint64_t>(dp_rank) << 32) | static_cast<uint64_t>(ctx.rank());
  if (!ctx.sharded_rng) ctx.sharded_rng = std::make_shared<Generator>();
  ctx.sharded_rng->manual_seed(mix(mix(seed + 1) ^ mix(ranks)));
}

Tensor rank_major_to_sequence(const Tensor& x, int tp, int chunks) {
  if (tp <= 1) return x;
  CHORUS_CHECK(x.dim() == 3 && x.size(0) % tp == 0, "rank_major_to_sequence: expected [tp * batch, seq / tp, features]",
               " over tp=", tp, ", got ", x.describe());
  const int64_t b = x.size(0) / tp, t = x.size(1), f = x.size(2);
  const int k = effective_chunks(chunks, b * t);
  // Note [Rank-major activations]: with whole sequences in each chunk, one
  // transposing copy takes [K][tp][B/K][T/tp] to [K][B/K][tp][T/tp] = [B, T].
  if (b % k == 0)
    return x.reshape({k, tp, b / k, t, f}).permute({0, 2, 1, 3, 4}).contiguous().reshape({b, tp * t, f});
  Tensor rm = chunk_major_to_rank_major(x, tp, k);
  return rm.reshape({tp, b, t, f}).permute({1, 0, 2, 3}).contiguous().reshape({b, tp * t, f});
}

Tensor sequence_to_rank_major(const Tensor& x, int tp, int chunks) {
  if (tp <= 1) return x;
  CHORUS_CHECK(x.dim() == 3 && x.size(1) % tp == 0, "sequence_to_rank_major: expected [batch, seq, features] with seq",
               " divisible by tp=", tp, ", got ", x.describe());
  const int64_t b = x.size(0), t = x.size(1) / tp, f = x.size(2);
  const int k = effective_chunks(chunks, b * t);
  if (b % k == 0)
    return x.reshape({k, b / k, tp, t, f}).permute({0, 2, 1, 3, 4}).contiguous().reshape({tp * b, t, f});
  Tensor rm = x.reshape({b, tp, t, f}).permute({1, 0, 2, 3}).contiguous().reshape({tp * b, t, f});
  return rank_major_to_chunk_major(rm, tp, k);
}

Tensor replicated_param(const Tensor& p, const TPContext& ctx) {
  return ctx.sequence_parallel ? copy_param_to_tp(p, ctx.group) : p;
}

Tensor parallel_dropout(const Tensor& x, double p, bool training, bool sharded, const TPContext& ctx) {
  if (!training || p == 0) return x;
  if (sharded && ctx.sharded_rng) {
    GeneratorGuard use(*ctx.sharded_rng);
    return F::dropout(x, p, training);
  }
  return F::dropout(x, p, training);
}

// ---- ColumnParallelLinear ----------------------------------------------------

ColumnParallelLinear::ColumnParallelLinear(ParallelLinearOptions o, TPContext ctx)
    : Module("ColumnParallelLinear"), opts_(o), ctx_(std::move(ctx)) {
  CHORUS_CHECK(o.in > 0 && o.out > 0 && o.blocks >= 1 && o.out % o.blocks == 0,
               "ColumnParallelLinear: bad sizes in ", o.in, ", out ", o.out, ", blocks ", o.blocks);
  check_divides(o.out / o.blocks, ctx_, "ColumnParallelLinear", "output features (per block)");
  const int64_t local = o.out / ctx_.size();
  if (o.init == Init::Full) {
    nn::Linear full(o.in, o.out, o.bias);
    NoGradGuard no_grad;
    register_parameter("weight", shard_of(full.weight(), shard_spec("weight"), ctx_.rank(), ctx_.size()));
    if (o.bias) register_parameter("bias", shard_of(full.bias(), shard_spec("bias"), ctx_.rank(), ctx_.size()));
  } else {
    register_parameter("weight", zeros({local, o.in}));
    if (o.bias) register_parameter("bias", zeros({local}));
  }
}

ShardSpec ColumnParallelLinear::shard_spec(const std::string&) const { return {0, opts_.blocks}; }

Tensor ColumnParallelLinear::forward(const Tensor& x) {
  Tensor in = on_own_device(x);
  const Tensor& w = own_parameters()[0].second;
  const Tensor b = opts_.bias ? own_parameters()[1].second : Tensor();
  // Note [Rank-major activations]: gathered along dim 0, the chunks side by side as the collective leaves them;
  // Note [Reduce-scatter beside the weight gradient].
  if (ctx_.sequence_parallel && in.dim() == 3) return gather_linear(in, w, b, ctx_.group, ctx_.chunks);
  in = ctx_.sequence_parallel ? rank_major_to_chunk_major(gather_from_sp(in.contiguous(), ctx_.group, kRankMajorDim),
                                                          ctx_.size(), ctx_.chunks)
                              : copy_to_tp(in, ctx_.group);
  return F::linear(in, w, b);
}

std::string ColumnParallelLinear::extra_repr() const {
  return "in_features=" + std::to_string(opts_.in) + ", out_features=" + std::to_string(opts_.out) + " / tp " +
         std::to_string(ctx_.size()) + (ctx_.sequence_parallel ? ", sequence_parallel" : "");
}

std::shared_ptr<nn::Module> ColumnParallelLinear::make_empty() const {
  ParallelLinearOptions o = opts_;
  o.init = Init::Zeros;
  return std::make_shared<ColumnParallelLinear>(o, ctx_);
}

// ---- RowParallelLinear -------------------------------------------------------

RowParallelLinear::RowParallelLinear(ParallelLinearOptions o, TPContext ctx)
    : Module("RowParallelLinear"), opts_(o), ctx_(std::move(ctx)) {
  CHORUS_CHECK(o.in > 0 && o.out > 0 && o.blocks == 1, "RowParallelLinear: bad sizes in ", o.in, ", out ", o.out);
  check_divides(o.in, ctx_, "RowParallelLinear", "input features");
  if (o.init == Init::Full) {
    nn::Linear full(o.in, o.out, o.bias);
    NoGradGuard no_grad;
    register_parameter("weight", shard_of(full.weight(), shard_spec("weight"), ctx_.rank(), ctx_.size()));
    if (o.bias) register_parameter("bias", full.bias().clone());
  } else {
    register_parameter("weight", zeros({o.out, o.in / ctx_.size()}));
    if (o.bias) register_parameter("bias", zeros({o.out}));
  }
}

ShardSpec RowParallelLinear::shard_spec(const std::string& param) const {
  return param == "weight" ? ShardSpec{1, 1} : ShardSpec{};
}

Tensor RowParallelLinear::forward(const Tensor& x) {
  // Note [The row-parallel bias on one rank]: product, reduce-scatter and bias as one op.
  if (ctx_.sequence_parallel && opts_.bias && is_parallel(ctx_.group) && x.dim() == 3)
    return linear_reduce_scatter(on_own_device(x), own_parameters()[0].second, own_parameters()[1].second, ctx_.group,
                                 ctx_.chunks);
  // The bias is added once, after the sum over the ranks.
  Tensor partial = F::linear(on_own_device(x), own_parameters()[0].second, Tensor());
  // Note [Rank-major activations]: the input, and so `partial`, in rank-major order (chunk-major over it).
  Tensor y = ctx_.sequence_parallel
                 ? reduce_scatter_to_sp(chunk_major_to_rank_major(partial, ctx_.size(), ctx_.chunks), ctx_.group,
                                        kRankMajorDim)
                 : reduce_from_tp(partial, ctx_.group);
  if (!opts_.bias) return y;
  return chorus::add(y, replicated_param(own_parameters()[1].second, ctx_));
}

std::string RowParallelLinear::extra_repr() const {
  return "in_features=" + std::to_string(opts_.in) + " / tp " + std::to_string(ctx_.size()) +
         ", out_features=" + std::to_string(opts_.out) + (ctx_.sequence_parallel ? ", sequence_parallel" : "");
}

std::shared_ptr<nn::Module> RowParallelLinear::make_empty() const {
  ParallelLinearOptions o = opts_;
  o.init = Init::Zeros;
  return std::make_shared<RowParallelLinear>(o, ctx_);
}

// ---- VocabParallelEmbedding --------------------------------------------------

VocabParallelEmbedding::VocabParallelEmbedding(VocabParallelEmbeddingOptions o, TPContext ctx)
    : Module("VocabParallelEmbedding"), opts_(o), ctx_(std::move(ctx)) {
  CHORUS_CHECK(o.num > 0 && o.dim > 0, "VocabParallelEmbedding: sizes must be positive, got ", o.num, " x ", o.dim);
  check_divides(o.num, ctx_, "VocabParallelEmbedding", "the vocabulary (embedding rows)");
  if (o.init == Init::Full) {
    nn::Embedding full(nn::EmbeddingOptions{o.num, o.dim});
    NoGradGuard no_grad;
    register_parameter("weight", shard_of(full.weight(), shard_spec("weight"), ctx_.rank(), ctx_.size()));
  } else {
    register_parameter("weight", zeros({o.num / ctx_.size(), o.dim}));
  }
}

ShardSpec VocabParallelEmbedding::shard_spec(const std::string&) const { return {0, 1}; }

Tensor VocabParallelEmbedding::forward(const Tensor& ids) {
  CHORUS_CHECK(ids.dtype() == kInt64 || ids.dtype() == kInt32, "VocabParallelEmbedding: ids must be integers, got ",
               ids.describe());
  Tensor& w = weight();
  if (!is_parallel(ctx_.group)) return F::embedding(w, ids);
  // This rank's rows are ids [start, start + rows); others look up row 0 and
  // are zeroed, so the sum over the ranks is the full table's lookup.
  const int64_t rows = rows_per_rank(), start = ctx_.rank() * rows;
  Tensor id = ids.to(w.device(), kInt64);
  Tensor mine = id.ge(full({}, double(start), {kInt64, w.device()}))
                    .mul(id.lt(full({}, double(start + rows), {kInt64, w.device()})));
  Tensor local = id.sub(full({}, double(start), {kInt64, w.device()})).mul(mine.to(kInt64));
  Tensor partial = chorus::mul(F::embedding(w, local), mine.to(w.dtype()).unsqueeze(-1));
  return ctx_.sequence_parallel ? reduce_scatter_to_sp(partial, ctx_.group, kSeqDim)
                                : reduce_from_tp(partial, ctx_.group);
}

std::string VocabParallelEmbedding::extra_repr() const {
  return std::to_string(opts_.num) + " / tp " + std::to_string(ctx_.size()) + ", " + std::to_string(opts_.dim);
}

std::shared_ptr<nn::Module> VocabParallelEmbedding::make_empty() const {
  VocabParallelEmbeddingOptions o = opts_;
  o.init = Init::Zeros;
  return std::make_shared<VocabParallelEmbedding>(o, ctx_);
}

// ---- ParallelLayerNorm -------------------------------------------------------

ParallelLayerNorm::ParallelLayerNorm(int64_t dim, TPContext ctx, double eps)
    : Module("LayerNorm"), dim_(dim), ctx_(std::move(ctx)), eps_(eps) {
  CHORUS_CHECK(dim > 0 && eps > 0, "LayerNorm: dim and eps must be positive, got ", dim, " and ", eps);
  register_parameter("weight", ones({dim}));
  register_parameter("bias", zeros({dim}));
}

Tensor ParallelLayerNorm::forward(const Tensor& x) {
  return F::layer_norm(on_own_device(x), replicated_param(own_parameters()[0].second, ctx_),
                       replicated_param(own_parameters()[1].second, ctx_), eps_);
}

std::string ParallelLayerNorm::extra_repr() const {
  return "(" + std::to_string(dim_) + ",), eps=" + std::to_string(eps_) + (ctx_.sequence_parallel ? ", sequence_parallel" : "");
}

std::shared_ptr<nn::Module> ParallelLayerNorm::make_empty() const {
  return std::make_shared<ParallelLayerNorm>(dim_, ctx_, eps_);
}

}  // namespace chorus::tp
