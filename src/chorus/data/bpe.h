// GPT-2's byte-level BPE tokenizer from its two files: vocab.json (token
// string -> id) and merges.txt (one "a b" merge per line, by priority).
//
// Text is split into pieces by GPT-2's pattern ('s 't 're 've 'm 'll 'd,
// " ?letters", " ?digits", " ?other", whitespace), each piece's bytes are
// mapped to GPT-2's printable stand-ins (bytes_to_unicode), merged pair by
// pair in merge order, and looked up in the vocabulary. Letters are ASCII
// letters and every non-ASCII character (GPT-2 uses Unicode's categories; the
// two agree on ASCII text and on where most other text splits). decode() is
// exact: the stand-ins map back to the bytes.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

namespace chorus::data {

class BpeTokenizer {
 public:
  // IOError naming the file for one that cannot be read or parsed.
  BpeTokenizer(const std::string& vocab_json, const std::string& merges_txt);
  std::vector<int64_t> encode(const std::string& text) const;
  // ValueError for an id not in the vocabulary.
  std::string decode(const std::vector<int64_t>& ids) const;
  int64_t vocab_size() const { return static_cast<int64_t>(id_to_token_.size()); }

 private:
  std::vector<std::string> bpe(const std::string& piece) const;
  std::unordered_map<std::string, int64_t> token_to_id_;
  std::vector<std::string> id_to_token_;
  std::map<std::pair<std::string, std::string>, int> ranks_;
  std::string byte_to_unicode_[256];
  std::unordered_map<std::string, uint8_t> unicode_to_byte_;
};

// GPT-2's split of text into the pieces BPE works on.
std::vector<std::string> gpt2_pieces(const std::string& text);

}  // namespace chorus::data
