// Token data (data/tokens.h): llm.c's token files written and read back,
// errors that name the file and what is wrong, the windows' coverage
// (disjoint per rank, every window once an epoch, a new order each epoch),
// text bytes, and GPT-2's BPE on a small vocabulary made here.
#include <gtest/gtest.h>

#include <fstream>
#include <set>

#include <chorus/chorus.h>
#include <chorus/data/bpe.h>
#include <chorus/data/tokens.h>
#include <chorus/io/token_file.h>

#include "io/io_test_util.h"
#include "testing/expect_error.h"

namespace chorus {
namespace {

using data::TokenStream;
using data::TokenWindows;
using data::WindowOrder;
using io::testing::ScratchDir;

std::vector<int64_t> iota_ids(int64_t n, int64_t mod = 65536) {
  std::vector<int64_t> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = (i * 7919) % mod;
  return v;
}

TEST(TokenFiles, RoundTripAcrossShards) {
  ScratchDir dir;
  auto a = iota_ids(1000), b = iota_ids(333, 50257);
  io::write_token_file(dir.file("x_000.bin"), a);
  io::write_token_file(dir.file("x_001.bin"), b);
  auto s = TokenStream::open("tokens:" + dir.file("x_*.bin"));
  ASSERT_EQ(s->shards(), 2);
  EXPECT_EQ(s->size(), 1333);
  for (int64_t i = 0; i < 1000; ++i) ASSERT_EQ(s->token(0, i), a[i]);
  for (int64_t i = 0; i < 333; ++i) ASSERT_EQ(s->token(1, i), b[i]);
  // The header as llm.c writes it.
  std::string raw = io::testing::read_bytes(dir.file("x_001.bin"));
  int32_t h[3];
  std::memcpy(h, raw.data(), sizeof h);
  EXPECT_EQ(h[0], 20240520);
  EXPECT_EQ(h[1], 1);
  EXPECT_EQ(h[2], 333);
  EXPECT_EQ(raw.size(), 1024u + 2 * 333);
}

TEST(TokenFiles, BadFilesAreNamed) {
  ScratchDir dir;
  io::write_token_file(dir.file("good.bin"), iota_ids(100));
  std::string raw = io::testing::read_bytes(dir.file("good.bin"));
  auto write = [&](const std::string& name, const std::string& bytes) {
    std::ofstream(dir.file(name), std::ios::binary) << bytes;
  };
  std::string magic = raw;
  magic[0] = 1;
  write("magic.bin", magic);
  EXPECT_TRUE(test::throws_naming<IOError>([&] { TokenStream::open("tokens:" + dir.file("magic.bin")); },
                                           {"magic.bin", "magic", "20240520"}));
  write("cut.bin", raw.substr(0, raw.size() - 10));
  EXPECT_TRUE(test::throws_naming<IOError>([&] { TokenStream::open("tokens:" + dir.file("cut.bin")); },
                                           {"cut.bin", "cut short", "100 tokens"}));
  write("tiny.bin", raw.substr(0, 100));
  EXPECT_TRUE(test::throws_naming<IOError>([&] { TokenStream::open("tokens:" + dir.file("tiny.bin")); }, {"tiny.bin", "header"}));
  std::string version = raw;
  version[4] = 2;
  write("version.bin", version);
  EXPECT_TRUE(test::throws_naming<IOError>([&] { TokenStream::open("tokens:" + dir.file("version.bin")); }, {"version 2"}));
  EXPECT_TRUE(test::throws_naming<IOError>([&] { TokenStream::open("tokens:" + dir.file("none_*.bin")); }, {"no token file"}));
  EXPECT_TRUE(test::throws_naming([&] { TokenStream::open("csv:" + dir.file("good.bin")); }, {"tokens:GLOB", "text:FILE"}));
  EXPECT_TRUE(test::throws_naming([&] { io::write_token_file(dir.file("big.bin"), {1, 70000}); }, {"70000", "16 bits"}));
  // A window longer than the data.
  auto s = TokenStream::open("tokens:" + dir.file("good.bin"));
  EXPECT_TRUE(test::throws_naming([&] { TokenWindows(s, 100, 0, 1, 0, WindowOrder::Sequential); }, {"100 tokens", "--seq-len 100"}));
}

TEST(TokenWindows, SequentialEpochsAreDisjointAcrossRanksAndReshuffled) {
  ScratchDir dir;
  // Tokens equal their positions (mod 65536), so a window names its start.
  std::vector<int64_t> ids(4 * 10 + 1);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(i);
  io::write_token_file(dir.file("t.bin"), ids);
  auto s = TokenStream::open("tokens:" + dir.file("t.bin"));
  const int world = 2;
  std::vector<std::vector<int64_t>> epoch_starts(2);
  for (int rank = 0; rank < world; ++rank) {
    TokenWindows w(s, 4, rank, world, 42, WindowOrder::Sequential);
    ASSERT_EQ(w.windows_per_rank(), 5);
    for (int64_t b = 0; b < 10; ++b) {  // batches of 1: two epochs
      auto [x, y] = w.batch(1, b);
      auto xv = x.to_vector<int64_t>(), yv = y.to_vector<int64_t>();
      for (int j = 0; j < 4; ++j) ASSERT_EQ(yv[j], xv[j] + 1);  // targets are the next tokens
      epoch_starts[b / 5].push_back(xv[0]);
    }
  }
  for (auto& starts : epoch_starts) {
    std::set<int64_t> unique(starts.begin(), starts.end());
    EXPECT_EQ(unique.size(), 10u) << "every window once an epoch, no rank sharing one";
    for (int64_t v : starts) EXPECT_EQ(v % 4, 0);
  }
  EXPECT_NE(epoch_starts[0], epoch_starts[1]) << "a new order each epoch";
  // A batch is a function of its index (a resumed run draws the same).
  TokenWindows w(s, 4, 1, world, 42, WindowOrder::Sequential);
  EXPECT_EQ(w.batch(3, 2).first.to_vector<int64_t>(), w.batch(3, 2).first.to_vector<int64_t>());
  // Random windows start anywhere, differ by rank.
  TokenWindows r0(s, 4, 0, 2, 42, WindowOrder::Random), r1(s, 4, 1, 2, 42, WindowOrder::Random);
  EXPECT_NE(r0.batch(8, 0).first.to_vector<int64_t>(), r1.batch(8, 0).first.to_vector<int64_t>());
}

TEST(TokenText, BytesAndRanges) {
  ScratchDir dir;
  std::string text;
  for (int i = 0; i < 1000; ++i) text += static_cast<char>('a' + i % 26);
  std::ofstream(dir.file("t.txt"), std::ios::binary) << text;
  auto all = TokenStream::open("text:" + dir.file("t.txt"));
  EXPECT_EQ(all->size(), 1000);
  EXPECT_EQ(all->natural_vocab(), 256);
  auto tail = TokenStream::open("text:" + dir.file("t.txt") + ":0.9-1");
  EXPECT_EQ(tail->size(), 100);
  EXPECT_EQ(tail->token(0, 0), 'a' + 900 % 26);
  EXPECT_TRUE(test::throws_naming([&] { TokenStream::open("text:" + dir.file("t.txt") + ":0.9-0.5"); }, {"0.9-0.5"}));
}

// A GPT-2-format vocabulary made here: the 256 byte stand-ins plus a few merges.
TEST(Bpe, EncodesAndDecodesWithASmallVocabulary) {
  ScratchDir dir;
  // bytes_to_unicode: printable ASCII stands for itself, space is U+0120 "Ġ".
  nlohmann::json vocab;
  int id = 0;
  for (int b = '!'; b <= '~'; ++b) vocab[std::string(1, static_cast<char>(b))] = id++;
  const std::string G = "\xC4\xA0";  // U+0120, the stand-in for ' '
  const std::string N = "\xC4\x8A";  // U+010A, the stand-in for '\n'
  vocab[G] = id++;
  vocab[N] = id++;
  for (const char* t : {"th", "the", "Ġthe", "Ġc", "Ġca", "Ġcat", "at"}) {
    std::string s = t;
    if (s.rfind("Ġ", 0) == 0) s = G + s.substr(2);
    vocab[s] = id++;
  }
  std::ofstream(dir.file("vocab.json")) << vocab.dump();
  std::ofstream(dir.file("merges.txt")) << "#version: 0.2\nt h\nth e\n" << G << " the\n" << G << " c\n" << G
                                        << "c a\n" << G << "ca t\na t\n";
  data::BpeTokenizer bpe(dir.file("vocab.json"), dir.file("merges.txt"));
  const std::string text = "the cat sat\n\nthe cat's";
  auto ids = bpe.encode(text);
  EXPECT_EQ(bpe.decode(ids), text);
  // "the" merges to one token, " cat" to one, "sat" to s + at.
  std::vector<std::string> toks;
  for (int64_t i : ids) toks.push_back(bpe.decode({i}));
  ASSERT_GE(toks.size(), 4u);
  EXPECT_EQ(toks[0], "the");
  EXPECT_EQ(toks[1], " cat");
  EXPECT_EQ(toks[2], " ");
  EXPECT_EQ(toks[3], "s");
  EXPECT_EQ(toks[4], "at");
  EXPECT_EQ(data::gpt2_pieces("the cat's  dog\n\nend"),
            (std::vector<std::string>{"the", " cat", "'s", " ", " dog", "\n", "\n", "end"}));
  EXPECT_TRUE(test::throws_naming([&] { bpe.decode({9999}); }, {"9999"}));
  std::ofstream(dir.file("bad.json")) << "{not json";
  EXPECT_TRUE(test::throws_naming<IOError>([&] { data::BpeTokenizer(dir.file("bad.json"), dir.file("merges.txt")); },
                                           {"bad.json"}));
}

}  // namespace
}  // namespace chorus
