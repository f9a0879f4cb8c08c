// The row order of a parallel region under sequence parallelism when the
// collectives run in chunks (Note [Chunked collectives beside the products]
// in sp_linear.h): each rank's m tokens split into K chunks of m/K rows, the
// gathered rows chunk-major over rank-major blocks, [K][tp][m/K]. K = 1 is
// the rank-major order of Note [Rank-major activations] in layers.h.
#pragma once

#include "chorus/core/tensor.h"

namespace chorus::tp {

// The chunks the collectives of a parallel region over `tokens` tokens per
// rank run in: `chunks` when it divides them, else 1 (the unchunked path:
// every op of the region decides alike, as all see the same token count).
int effective_chunks(int chunks, int64_t tokens);

// Between rank-major [tp][m] and chunk-major [K][tp][m/K] rows of x (its
// leading dims flattened into rows of x.size(-1) features, tp * m rows; the
// shape is kept), with autograd; K as effective_chunks(chunks, m). The
// identity for K = 1 or tp = 1.
Tensor rank_major_to_chunk_major(const Tensor& x, int tp, int chunks);
Tensor chunk_major_to_rank_major(const Tensor& x, int tp, int chunks);

}  // namespace chorus::tp
