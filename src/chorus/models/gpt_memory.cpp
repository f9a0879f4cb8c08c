#include "chorus/models/gpt_memory.h"

#include <algorithm>

namespace chorus::models {

GPTActivationBytes gpt_activation_bytes(const GPTConfig& cfg, int64_t batch, int64_t seq, bool bf16,
                                        bool fused_attention, bool logits_overwritten) {
  // Note [GPT activation count], term by term.
  const int64_t s = bf16 ? 2 : 4, n = batch * seq, c = cfg.width, h = cfg.heads;
  const int64_t nc = n * c * s;
  const int64_t norms = 2 * (2 * n * 4);  // ln_1's and ln_2's mean and rstd
  const int64_t attention = fused_attention ? batch * h * seq * 4 : batch * h * seq * seq * s + nc;
  const bool drop = cfg.dropout > 0;
  // Dropout keeps a mask per residual branch and, composite, per attention matrix.
  const int64_t masks = drop ? 2 * nc + (fused_attention ? 0 : batch * h * seq * seq * s) : 0;
  // --recompute-gelu: the MLP keeps GELU's input only (4 N C s less), and
  // the backward holds the recomputed output beside its gradients.
  const int64_t gelu_out = cfg.recompute_gelu ? 0 : 4 * nc;
  const int64_t block = 12 * nc + gelu_out + norms + attention + masks;

  GPTActivationBytes a;
  a.embeddings = 2 * n * 8 + seq * 8 + (drop ? nc : 0);
  // A block's backward begins with the MLP's: its incoming gradient, dpre
  // (4 N C), dx and the residual's gradient beside the block's whole set,
  // and c_fc's weight gradient (16-bit, then its float32 cast under autocast).
  const int64_t backward = 10 * nc + (4 * nc - gelu_out) + 4 * c * c * (s + (bf16 ? 4 : 0));
  const int64_t head = 2 * nc + 2 * n * 4 + n * 4 + gpt_logits_bytes(cfg, batch, seq, bf16, logits_overwritten);
  // A recomputed block keeps its input; the backward recomputes one block at
  // a time: its set (its input aside), its output and the gradient into it.
  // The others keep their whole set (Note [Recomputing some blocks] in
  // gpt.cpp). The recomputed blocks are the first k, whose backward runs
  // last, when the other L - k blocks' sets are gone: that moment's peak is
  // on top of the k inputs alone, less what `blocks` counts beyond them.
  const int64_t k = cfg.recomputed_blocks();
  a.blocks = k * nc + (cfg.layers - k) * block;
  const int64_t recomputing = k > 0 ? (block - nc) + 2 * nc + backward - (cfg.layers - k) * block : 0;
  a.peak = std::max({head, backward, recomputing});
  return a;
}

int64_t gpt_logits_bytes(const GPTConfig& cfg, int64_t batch, int64_t seq, bool bf16, bool logits_overwritten) {
  const int64_t s = bf16 ? 2 : 4, n = batch * seq, c = cfg.width, vp = cfg.padded_vocab;
  const int64_t logits = n * vp * s;
  // The end of the forward (logits and their gradient, one buffer when the
  // gradient is written over them) or the backward's start (that gradient
  // and the tied embedding's weight gradient, cast to float32 under
  // autocast).
  return std::max((logits_overwritten ? 1 : 2) * logits, logits + vp * c * (s + (bf16 ? 4 : 0)));
}

int64_t gpt_block_parameters(const GPTConfig& cfg) {
  const int64_t c = cfg.width;
  return 2 * 2 * c + (c * 3 * c + 3 * c) + (c * c + c) + (c * 4 * c + 4 * c) + (4 * c * c + c);
}

int64_t gpt_root_parameters(const GPTConfig& cfg) {
  return cfg.padded_vocab * cfg.width + cfg.context * cfg.width + 2 * cfg.width;
}

int64_t gpt_autocast_copied_parameters(const GPTConfig& cfg) {
  const int64_t c = cfg.width;
  const int64_t block_norms = 2 * 2 * c;
  return cfg.padded_vocab * c + cfg.layers * (gpt_block_parameters(cfg) - block_norms);
}

}  // namespace chorus::models
