#include "chorus/data/tokens.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <numeric>
#include <random>

#include "chorus/core/error.h"
#include "chorus/ops/factory.h"

namespace chorus::data {

namespace {

struct Mapping {
  void* addr = nullptr;
  size_t size = 0;
};

// The whole file, read-only and shared (the page cache serves every rank of a
// machine from one copy). An empty file maps to nothing.
Mapping map_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  CHORUS_CHECK_T(IOError, fd >= 0, "cannot open token data '", path, "': ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    CHORUS_THROW(IOError, "cannot read '", path, "': ", std::strerror(e));
  }
  Mapping m;
  m.size = static_cast<size_t>(st.st_size);
  if (m.size > 0) {
    m.addr = ::mmap(nullptr, m.size, PROT_READ, MAP_SHARED, fd, 0);
    if (m.addr == MAP_FAILED) {
      const int e = errno;
      ::close(fd);
      CHORUS_THROW(IOError, "cannot map '", path, "': ", std::strerror(e));
    }
  }
  ::close(fd);
  return m;
}

uint64_t mix(uint64_t a, uint64_t b) {  // splitmix64 of a combined key
  uint64_t z = a * 0x9E3779B97F4A7C15ull + b + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

std::shared_ptr<TokenStream> TokenStream::open(const std::string& spec) {
  if (spec.rfind("tokens:", 0) == 0) return token_files(spec.substr(7));
  if (spec.rfind("text:", 0) == 0) {
    std::string rest = spec.substr(5);
    double from = 0, to = 1;
    // text:FILE:A-B -- a fraction range at the end, when it parses as one.
    const size_t colon = rest.rfind(':');
    if (colon != std::string::npos) {
      const std::string range = rest.substr(colon + 1);
      const size_t dash = range.find('-');
      char* end1 = nullptr;
      char* end2 = nullptr;
      if (dash != std::string::npos) {
        const std::string a = range.substr(0, dash), b = range.substr(dash + 1);
        const double fa = std::strtod(a.c_str(), &end1), fb = std::strtod(b.c_str(), &end2);
        if (!a.empty() && !b.empty() && *end1 == '\0' && *end2 == '\0') {
          CHORUS_CHECK(fa >= 0 && fb <= 1 && fa < fb, "--data ", spec, ": the range ", range,
                       " must be two fractions 0 <= A < B <= 1");
          from = fa;
          to = fb;
          rest = rest.substr(0, colon);
        }
      }
    }
    auto s = text_bytes(rest, from, to);
    s->spec_ = spec;
    return s;
  }
  CHORUS_THROW(ValueError, "token data '", spec, "' must be tokens:GLOB (llm.c token files) or text:FILE (bytes)");
}

std::shared_ptr<TokenStream> TokenStream::token_files(const std::string& pattern) {
  glob_t g{};
  const int rc = ::glob(pattern.c_str(), 0, nullptr, &g);
  std::vector<std::string> paths;
  if (rc == 0)
    for (size_t i = 0; i < g.gl_pathc; ++i) paths.emplace_back(g.gl_pathv[i]);
  ::globfree(&g);
  CHORUS_CHECK_T(IOError, !paths.empty(), "no token file matches '", pattern, "'");
  std::sort(paths.begin(), paths.end());
  std::shared_ptr<TokenStream> s(new TokenStream());
  s->spec_ = "tokens:" + pattern;
  for (const std::string& p : paths) {
    Mapping m = map_file(p);
    Shard sh;
    sh.path = p;
    sh.map = m.addr;
    sh.map_size = m.size;
    s->shards_.push_back(sh);  // owned from here: the destructor unmaps it
    const size_t header_bytes = kTokenFileHeaderInts * 4;
    CHORUS_CHECK_T(IOError, m.size >= header_bytes, "token file '", p, "' is ", m.size,
                   " bytes, shorter than llm.c's 1024-byte header");
    int32_t header[kTokenFileHeaderInts];
    std::memcpy(header, m.addr, header_bytes);
    CHORUS_CHECK_T(IOError, header[0] == kTokenFileMagic, "token file '", p, "': magic ", header[0],
                   " at byte 0 is not llm.c's ", kTokenFileMagic, " (not a token file?)");
    CHORUS_CHECK_T(IOError, header[1] == 1, "token file '", p, "': version ", header[1],
                   " at byte 4 (expected 1: uint16 tokens)");
    const int64_t count = header[2];
    CHORUS_CHECK_T(IOError, count >= 0 && static_cast<uint64_t>(count) * 2 + header_bytes <= m.size, "token file '", p,
                   "' is cut short: its header promises ", count, " tokens (", count * 2 + header_bytes,
                   " bytes), the file has ", m.size, " bytes");
    s->shards_.back().ids16 = reinterpret_cast<const uint16_t*>(static_cast<const char*>(m.addr) + header_bytes);
    s->shards_.back().count = count;
  }
  return s;
}

std::shared_ptr<TokenStream> TokenStream::text_bytes(const std::string& path, double from, double to) {
  std::shared_ptr<TokenStream> s(new TokenStream());
  s->spec_ = "text:" + path;
  s->text_ = true;
  Mapping m = map_file(path);
  Shard sh;
  sh.path = path;
  sh.map = m.addr;
  sh.map_size = m.size;
  const int64_t n = static_cast<int64_t>(m.size);
  const int64_t a = static_cast<int64_t>(std::floor(from * static_cast<double>(n)));
  const int64_t b = static_cast<int64_t>(std::floor(to * static_cast<double>(n)));
  sh.bytes = m.addr ? static_cast<const uint8_t*>(m.addr) + a : nullptr;  // an empty file maps to nothing
  sh.count = b - a;
  s->shards_.push_back(sh);
  return s;
}

TokenStream::~TokenStream() {
  for (Shard& s : shards_)
    if (s.map) ::munmap(s.map, s.map_size);
}

int64_t TokenStream::size() const {
  int64_t n = 0;
  for (const Shard& s : shards_) n += s.count;
  return n;
}

int64_t TokenStream::token(int64_t shard, int64_t i) const {
  const Shard& s = shards_[shard];
  return s.ids16 ? static_cast<int64_t>(s.ids16[i]) : static_cast<int64_t>(s.bytes[i]);
}

int64_t TokenStream::max_token() const {
  if (max_token_ >= 0) return max_token_;
  int64_t m = 0;
  for (const Shard& s : shards_) {
    for (int64_t i = 0; i < s.count; ++i) m = std::max<int64_t>(m, s.ids16 ? s.ids16[i] : s.bytes[i]);
  }
  return max_token_ = m;
}

TokenWindows::TokenWindows(std::shared_ptr<TokenStream> stream, int64_t seq, int rank, int world, uint64_t seed,
                           WindowOrder order)
    : stream_(std::move(stream)), seq_(seq), rank_(rank), world_(world), seed_(seed), order_(order) {
  CHORUS_CHECK(seq_ >= 1, "--seq-len must be at least 1, got ", seq_);
  CHORUS_CHECK(world_ >= 1 && rank_ >= 0 && rank_ < world_, "TokenWindows: rank ", rank_, " of ", world_);
  for (int64_t s = 0; s < stream_->shards(); ++s) {
    first_window_.push_back(total_);
    const int64_t n = stream_->shard_size(s);
    if (n > seq_) total_ += (n - 1) / seq_;
  }
  CHORUS_CHECK(total_ > 0, "token data ", stream_->spec(), " holds ", stream_->size(),
               " tokens: no window of --seq-len ", seq_, " + 1 tokens fits (use a shorter --seq-len or more data)");
  per_rank_ = total_ / world_;
  CHORUS_CHECK(per_rank_ > 0, "token data ", stream_->spec(), " holds ", total_, " windows of ", seq_,
               " tokens, fewer than the ", world_, " ranks");
}

std::pair<int64_t, int64_t> TokenWindows::locate(int64_t w) const {
  auto it = std::upper_bound(first_window_.begin(), first_window_.end(), w);
  const int64_t shard = static_cast<int64_t>(it - first_window_.begin()) - 1;
  return {shard, (w - first_window_[shard]) * seq_};
}

void TokenWindows::fill(int64_t shard, int64_t first, int64_t* ids, int64_t* targets) const {
  for (int64_t i = 0; i < seq_; ++i) {
    ids[i] = stream_->token(shard, first + i);
    targets[i] = stream_->token(shard, first + i + 1);
  }
}

std::pair<Tensor, Tensor> TokenWindows::batch(int64_t batch_size, int64_t index) const {
  Tensor ids = empty({batch_size, seq_}, {kInt64, cpu_device(0)});
  Tensor tg = empty({batch_size, seq_}, {kInt64, cpu_device(0)});
  int64_t* pi = ids.data<int64_t>();
  int64_t* pt = tg.data<int64_t>();
  if (order_ == WindowOrder::Random) {
    // Any start in any shard long enough, weighted by the shard's windows.
    std::mt19937_64 gen(mix(mix(seed_, static_cast<uint64_t>(rank_)), static_cast<uint64_t>(index)));
    for (int64_t r = 0; r < batch_size; ++r) {
      const auto [shard, unused] = locate(static_cast<int64_t>(gen() % static_cast<uint64_t>(total_)));
      (void)unused;
      const int64_t span = stream_->shard_size(shard) - seq_;  // starts 0 .. n - seq - 1
      const int64_t first = static_cast<int64_t>(gen() % static_cast<uint64_t>(span));
      fill(shard, first, pi + r * seq_, pt + r * seq_);
    }
    return {ids, tg};
  }
  // Note [Token windows]: position p of this rank's sequence over epochs.
  std::lock_guard<std::mutex> lock(order_mu_);
  for (int64_t r = 0; r < batch_size; ++r) {
    const int64_t p = index * batch_size + r;
    const int64_t epoch = p / per_rank_, k = p % per_rank_;
    if (order_epoch_ != epoch) {  // this epoch's order of all windows, the same on every rank
      epoch_order_.resize(static_cast<size_t>(total_));
      std::iota(epoch_order_.begin(), epoch_order_.end(), int64_t{0});
      std::mt19937_64 gen(mix(seed_, static_cast<uint64_t>(epoch)));
      std::shuffle(epoch_order_.begin(), epoch_order_.end(), gen);
      order_epoch_ = epoch;
    }
    const auto [shard, first] = locate(epoch_order_[static_cast<size_t>(k * world_ + rank_)]);
    fill(shard, first, pi + r * seq_, pt + r * seq_);
  }
  return {ids, tg};
}

std::pair<Tensor, Tensor> TokenWindows::spaced(int64_t count) const {
  count = std::max<int64_t>(1, std::min(count, total_));
  Tensor ids = empty({count, seq_}, {kInt64, cpu_device(0)});
  Tensor tg = empty({count, seq_}, {kInt64, cpu_device(0)});
  for (int64_t r = 0; r < count; ++r) {
    const int64_t w = count == 1 ? 0 : r * (total_ - 1) / (count - 1);
    const auto [shard, first] = locate(w);
    fill(shard, first, ids.data<int64_t>() + r * seq_, tg.data<int64_t>() + r * seq_);
  }
  return {ids, tg};
}

}  // namespace chorus::data
