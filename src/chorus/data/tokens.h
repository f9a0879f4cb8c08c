// Token streams for language models: llm.c's token files, memory-mapped, and
// the bytes of a text file (a vocabulary of 256), cut into windows of
// seq + 1 tokens (the inputs and, shifted by one, the targets).
//
// Note [Token windows]: a stream of n tokens holds floor((n - 1) / seq)
// non-overlapping windows; a shard's windows never reach into the next
// shard. Sequential order: every epoch the windows of all shards are put in
// an order drawn from (seed, epoch), the same on every rank, and rank r takes
// every world-th window from position r on, so ranks see disjoint windows and
// each epoch a new order without a call from the loop. Random order: every
// batch row a window starting anywhere (torch_gpt.py's sampling), drawn from
// (seed, rank, batch index), so ranks differ. Either way a batch is a pure
// function of its index: a resumed run draws what the uninterrupted run would.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "chorus/core/tensor.h"

namespace chorus::data {

// llm.c's token file: int32 header[256] = {20240520, 1, count, 0...}, then
// `count` uint16 token ids.
constexpr int32_t kTokenFileMagic = 20240520;
constexpr int64_t kTokenFileHeaderInts = 256;

class TokenStream {
 public:
  // `tokens:GLOB` or `text:FILE[:FROM-TO]` (the fraction of the text's bytes,
  // e.g. text:kjv.txt:0-0.9), as --data takes it. IOError for a missing file,
  // a wrong magic or version, a count the file's size does not hold;
  // ValueError for a spec of another form.
  static std::shared_ptr<TokenStream> open(const std::string& spec);
  // The tokens of the token files matching `pattern` (sorted by name).
  static std::shared_ptr<TokenStream> token_files(const std::string& pattern);
  // The bytes [from, to) of a text file as tokens 0..255.
  static std::shared_ptr<TokenStream> text_bytes(const std::string& path, double from = 0.0, double to = 1.0);
  ~TokenStream();
  TokenStream(const TokenStream&) = delete;
  TokenStream& operator=(const TokenStream&) = delete;

  int64_t shards() const { return static_cast<int64_t>(shards_.size()); }
  int64_t shard_size(int64_t s) const { return shards_[s].count; }
  int64_t size() const;  // tokens over all shards
  int64_t token(int64_t shard, int64_t i) const;
  // The largest id (a scan, once; checked against the model's vocabulary).
  int64_t max_token() const;
  // 256 for text, else 0 (the model's vocabulary decides).
  int64_t natural_vocab() const { return text_ ? 256 : 0; }
  const std::string& spec() const { return spec_; }

 private:
  struct Shard {
    std::string path;
    const uint16_t* ids16 = nullptr;  // token file: into the mapping
    const uint8_t* bytes = nullptr;   // text: into the mapping
    int64_t count = 0;
    void* map = nullptr;
    size_t map_size = 0;
  };
  TokenStream() = default;
  std::vector<Shard> shards_;
  std::string spec_;
  bool text_ = false;
  mutable int64_t max_token_ = -1;
};

enum class WindowOrder { Sequential, Random };

class TokenWindows {
 public:
  // ValueError when the stream holds no window of seq + 1 tokens (naming the
  // file and both lengths), or seq < 1.
  TokenWindows(std::shared_ptr<TokenStream> stream, int64_t seq, int rank, int world, uint64_t seed,
               WindowOrder order);
  // Windows this rank sees per epoch (sequential order; random: the same count).
  int64_t windows_per_rank() const { return per_rank_; }
  // Batch `index` of this rank (index counts over epochs): {ids, targets},
  // each int64 [batch, seq] on the host.
  std::pair<Tensor, Tensor> batch(int64_t batch_size, int64_t index) const;
  // `count` evenly spaced windows (the same on every rank), for validation.
  std::pair<Tensor, Tensor> spaced(int64_t count) const;
  int64_t seq() const { return seq_; }

 private:
  // Window w (over all shards) as {shard, first token}.
  std::pair<int64_t, int64_t> locate(int64_t w) const;
  void fill(int64_t shard, int64_t first, int64_t* ids, int64_t* targets) const;
  std::shared_ptr<TokenStream> stream_;
  int64_t seq_;
  int rank_, world_;
  uint64_t seed_;
  WindowOrder order_;
  std::vector<int64_t> first_window_;  // per shard: index of its first window
  int64_t total_ = 0, per_rank_ = 0;
  // The current epoch's order of the windows (sequential order), made when
  // a batch of another epoch is asked for.
  mutable std::mutex order_mu_;
  mutable std::vector<int64_t> epoch_order_;
  mutable int64_t order_epoch_ = -1;
};

}  // namespace chorus::data
