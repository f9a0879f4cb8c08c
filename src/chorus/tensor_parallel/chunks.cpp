#include "chorus/tensor_parallel/chunks.h"

#include "chorus/core/error.h"

namespace chorus::tp {

int effective_chunks(int chunks, int64_t tokens) {
  CHORUS_CHECK(chunks >= 1, "tensor parallel: --tp-chunks must be at least 1, got ", chunks);
  return tokens > 0 && tokens % chunks == 0 ? chunks : 1;
}

namespace {

// x's rows as [a, b, rows / (a b), features], swapped to [b, a, ...] and back in x's shape.
Tensor swap_row_blocks(const Tensor& x, int64_t a, int64_t b) {
  const int64_t f = x.size(-1), rows = x.numel() / f;
  return x.reshape({a, b, rows / (a * b), f}).permute({1, 0, 2, 3}).contiguous().reshape(x.sizes());
}

// K for x's rows over tp ranks (1 where nothing moves).
int chunks_of(const Tensor& x, int tp, int chunks, const char* fn) {
  if (tp <= 1 || chunks <= 1) return 1;
  CHORUS_CHECK(x.dim() >= 1 && x.size(-1) > 0 && (x.numel() / x.size(-1)) % tp == 0, fn, ": ", x.describe(),
               " does not hold rows of ", tp, " ranks");
  return effective_chunks(chunks, x.numel() / x.size(-1) / tp);
}

}  // namespace

Tensor rank_major_to_chunk_major(const Tensor& x, int tp, int chunks) {
  const int k = chunks_of(x, tp, chunks, "rank_major_to_chunk_major");
  return k == 1 ? x : swap_row_blocks(x, tp, k);
}

Tensor chunk_major_to_rank_major(const Tensor& x, int tp, int chunks) {
  const int k = chunks_of(x, tp, chunks, "chunk_major_to_rank_major");
  return k == 1 ? x : swap_row_blocks(x, k, tp);
}

}  // namespace chorus::tp
