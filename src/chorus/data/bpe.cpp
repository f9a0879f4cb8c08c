#include "chorus/data/bpe.h"

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "chorus/core/error.h"

namespace chorus::data {

namespace {

std::string utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  CHORUS_CHECK_T(IOError, in.good(), "cannot read '", path, "'");
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

bool is_letter(unsigned char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c >= 0x80; }
bool is_digit(unsigned char c) { return c >= '0' && c <= '9'; }
bool is_space(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

// The UTF-8 characters of s (a stand-in string).
std::vector<std::string> chars_of(const std::string& s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

}  // namespace

std::vector<std::string> gpt2_pieces(const std::string& text) {
  std::vector<std::string> out;
  const size_t n = text.size();
  auto at = [&](size_t i) { return static_cast<unsigned char>(text[i]); };
  size_t i = 0;
  while (i < n) {
    // Contractions: 's 't 're 've 'm 'll 'd
    if (text[i] == '\'') {
      bool matched = false;
      for (const char* c : {"s", "t", "re", "ve", "m", "ll", "d"}) {
        const size_t len = std::char_traits<char>::length(c);
        if (text.compare(i + 1, len, c) == 0) {
          out.push_back(text.substr(i, len + 1));
          i += len + 1;
          matched = true;
          break;
        }
      }
      if (matched) continue;
    }
    const size_t start = i;
    const bool lead_space = text[i] == ' ' && i + 1 < n && !is_space(at(i + 1));
    const size_t j = lead_space ? i + 1 : i;
    if (is_letter(at(j))) {
      i = j;
      while (i < n && is_letter(at(i))) ++i;
    } else if (is_digit(at(j))) {
      i = j;
      while (i < n && is_digit(at(i))) ++i;
    } else if (!is_space(at(j))) {
      i = j;
      while (i < n && !is_space(at(i)) && !is_letter(at(i)) && !is_digit(at(i))) ++i;
    } else {
      // Whitespace: a run, leaving its last character to the next piece when
      // something other than whitespace follows (\s+(?!\S), then \s+).
      while (i < n && is_space(at(i))) ++i;
      if (i < n && i - start > 1) --i;
    }
    out.push_back(text.substr(start, i - start));
  }
  return out;
}

BpeTokenizer::BpeTokenizer(const std::string& vocab_json, const std::string& merges_txt) {
  // bytes_to_unicode: printable bytes stand for themselves, the rest for 256 + k.
  int extra = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    byte_to_unicode_[b] = utf8(printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + extra++));
    unicode_to_byte_[byte_to_unicode_[b]] = static_cast<uint8_t>(b);
  }
  nlohmann::json vocab;
  try {
    vocab = nlohmann::json::parse(read_text(vocab_json));
  } catch (const nlohmann::json::exception& e) {
    CHORUS_THROW(IOError, "'", vocab_json, "' is not a GPT-2 vocab.json: ", e.what());
  }
  CHORUS_CHECK_T(IOError, vocab.is_object() && !vocab.empty(), "'", vocab_json, "' is not an object of token -> id");
  int64_t max_id = -1;
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    CHORUS_CHECK_T(IOError, it.value().is_number_integer() && it.value().get<int64_t>() >= 0, "'", vocab_json,
                   "': the id of '", it.key(), "' is not a non-negative integer");
    max_id = std::max(max_id, it.value().get<int64_t>());
  }
  id_to_token_.assign(static_cast<size_t>(max_id + 1), std::string());
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    token_to_id_[it.key()] = it.value().get<int64_t>();
    id_to_token_[static_cast<size_t>(it.value().get<int64_t>())] = it.key();
  }
  std::istringstream merges(read_text(merges_txt));
  std::string line;
  int rank = 0, lineno = 0;
  while (std::getline(merges, line)) {
    ++lineno;
    if (line.empty() || line.rfind("#version", 0) == 0) continue;
    const size_t sp = line.find(' ');
    CHORUS_CHECK_T(IOError, sp != std::string::npos && sp > 0 && sp + 1 < line.size(), "'", merges_txt, "' line ",
                   lineno, " is not a merge \"a b\": '", line, "'");
    ranks_[{line.substr(0, sp), line.substr(sp + 1)}] = rank++;
  }
}

std::vector<std::string> BpeTokenizer::bpe(const std::string& piece) const {
  std::vector<std::string> word;
  for (unsigned char c : piece) word.push_back(byte_to_unicode_[c]);
  while (word.size() > 1) {
    int best = -1;
    size_t at = 0;
    for (size_t k = 0; k + 1 < word.size(); ++k) {
      auto it = ranks_.find({word[k], word[k + 1]});
      if (it != ranks_.end() && (best < 0 || it->second < best)) {
        best = it->second;
        at = k;
      }
    }
    if (best < 0) break;
    // Merge every occurrence of the best pair, left to right.
    const std::string a = word[at], b = word[at + 1];
    std::vector<std::string> merged;
    for (size_t k = 0; k < word.size();) {
      if (k + 1 < word.size() && word[k] == a && word[k + 1] == b) {
        merged.push_back(a + b);
        k += 2;
      } else {
        merged.push_back(word[k++]);
      }
    }
    word = std::move(merged);
  }
  return word;
}

std::vector<int64_t> BpeTokenizer::encode(const std::string& text) const {
  std::vector<int64_t> ids;
  for (const std::string& piece : gpt2_pieces(text)) {
    for (const std::string& tok : bpe(piece)) {
      auto it = token_to_id_.find(tok);
      if (it != token_to_id_.end()) {
        ids.push_back(it->second);
        continue;
      }
      // A token the vocabulary lacks: its characters one by one (every byte
      // stand-in is in a real GPT-2 vocabulary).
      for (const std::string& ch : chars_of(tok)) {
        auto c = token_to_id_.find(ch);
        CHORUS_CHECK(c != token_to_id_.end(), "BPE: the vocabulary has no token for the byte stand-in '", ch, "'");
        ids.push_back(c->second);
      }
    }
  }
  return ids;
}

std::string BpeTokenizer::decode(const std::vector<int64_t>& ids) const {
  std::string out;
  for (int64_t id : ids) {
    CHORUS_CHECK(id >= 0 && id < vocab_size() && !id_to_token_[static_cast<size_t>(id)].empty(), "BPE: id ", id,
                 " is not in the vocabulary of ", vocab_size());
    for (const std::string& ch : chars_of(id_to_token_[static_cast<size_t>(id)])) {
      auto it = unicode_to_byte_.find(ch);
      CHORUS_CHECK(it != unicode_to_byte_.end(), "BPE: token ", id, " holds a character that stands for no byte");
      out += static_cast<char>(it->second);
    }
  }
  return out;
}

}  // namespace chorus::data
