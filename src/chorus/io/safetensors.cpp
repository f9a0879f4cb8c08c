#include "chorus/io/safetensors.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/io/file_util.h"
#include "chorus/io/json_util.h"
#include "chorus/ops/copy.h"

namespace chorus::io {

// The data section is the host's memory image of each tensor.
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

namespace {

using json = nlohmann::json;

// The reference reader's limit: a bigger header is corruption, not a model.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// A valid header nests three deep ({"name": {"shape": [...]}}); the margin is
// for other writers' metadata. See Note [Untrusted JSON].
constexpr int kMaxHeaderDepth = 16;
constexpr const char* kMetadataKey = "__metadata__";

// A CPU tensor with the same values, contiguous: the bytes to write.
Tensor host_contiguous(const Tensor& t) {
  Tensor h = ops::contiguous(ops::to_device(t, cpu_device(0)));
  // A device-to-host copy may still be in flight on the source device's stream.
  if (!t.device().is_cpu()) synchronize(t.device());
  return h;
}

}  // namespace

const char* safetensors_dtype_name(DType t) {
  switch (t) {
    case DType::Float32: return "F32";
    case DType::BFloat16: return "BF16";
    case DType::Float16: return "F16";
    case DType::Int64: return "I64";
    case DType::Int32: return "I32";
    case DType::UInt8: return "U8";
    case DType::Bool: return "BOOL";
    case DType::Float64: return "F64";
  }
  return "?";
}

bool parse_safetensors_dtype(const std::string& name, DType* out) {
  for (DType t : {kFloat32, kBFloat16, kFloat16, kInt64, kInt32, kUInt8, kBool, kFloat64}) {
    if (name == safetensors_dtype_name(t)) {
      *out = t;
      return true;
    }
  }
  return false;
}

// ---- writing ------------------------------------------------------------------

void save_safetensors(const std::string& path, const nn::NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata) {
  std::set<std::string> names;
  for (const auto& [name, t] : tensors) {
    CHORUS_CHECK(name != kMetadataKey, "save_safetensors(", path, "): '", kMetadataKey,
                 "' is reserved for metadata and cannot name a tensor");
    CHORUS_CHECK(names.insert(name).second, "save_safetensors(", path, "): tensor name '", name,
                 "' appears twice");
    CHORUS_CHECK(t.defined(), "save_safetensors(", path, "): tensor '", name, "' is undefined");
  }
  // Larger elements first: with an 8-byte-aligned data section every tensor
  // then starts at a multiple of its element size. Stable, so a one-dtype
  // list keeps the caller's order.
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return tensors[a].second.element_size() > tensors[b].second.element_size();
  });

  json header = json::object();
  uint64_t offset = 0;
  for (size_t i : order) {
    const auto& [name, t] = tensors[i];
    json shape = json::array();
    for (int64_t d : t.sizes()) shape.push_back(d);
    const uint64_t nbytes = t.nbytes();
    header[name] = {{"dtype", safetensors_dtype_name(t.dtype())},
                    {"shape", shape},
                    {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {  // e.g. a name that is not UTF-8
    CHORUS_THROW(ValueError, "save_safetensors(", path, "): cannot encode the header: ", e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');

  detail::AtomicFile file(path);
  uint8_t len[8];
  for (int b = 0; b < 8; ++b) len[b] = static_cast<uint8_t>(uint64_t(text.size()) >> (8 * b));
  file.write(len, 8);
  file.write(text.data(), text.size());
  for (size_t i : order) {
    const Tensor& t = tensors[i].second;
    if (t.numel() == 0) continue;
    Tensor h = host_contiguous(t);
    file.write(h.raw_data(), h.nbytes());
  }
  file.commit();
}

// ---- reading ------------------------------------------------------------------

namespace {

struct Entry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin, end;
};

class Reader {
 public:
  explicit Reader(std::string path) : path_(std::move(path)) {}

  nn::NamedTensors read(std::map<std::string, std::string>* metadata) {
    std::error_code ec;
    if (std::filesystem::is_directory(path_, ec)) fail("is a directory, not a safetensors file");
    in_.open(path_, std::ios::binary);
    if (!in_) fail("cannot open for reading: ", std::strerror(errno));
    in_.seekg(0, std::ios::end);
    file_size_ = static_cast<uint64_t>(in_.tellg());
    in_.seekg(0);
    if (file_size_ < 8)
      fail("file is ", file_size_, " bytes, too short to hold the 8-byte header length");
    uint8_t len[8];
    read_at(0, len, 8, "the header length");
    uint64_t n = 0;
    for (int b = 0; b < 8; ++b) n |= uint64_t(len[b]) << (8 * b);
    if (n > file_size_ - 8)
      fail("header length ", n, " (bytes [0, 8)) runs past the end of the file: the header would need bytes [8, ",
           n > kMaxHeaderBytes ? "..." : std::to_string(8 + n), ") but the file has ", file_size_, " bytes");
    if (n > kMaxHeaderBytes) fail("header length ", n, " (bytes [0, 8)) exceeds the format's limit of ", kMaxHeaderBytes);
    data_start_ = 8 + n;
    data_size_ = file_size_ - data_start_;
    std::string text(n, '\0');
    read_at(8, text.data(), n, "the header");

    std::vector<Entry> entries = parse_header(text, metadata);
    check_tiling(entries);

    nn::NamedTensors out;
    for (const Entry& e : entries) out.emplace_back(e.name, read_tensor(e));
    return out;
  }

 private:
  template <typename... Args>
  [[noreturn]] void fail(const Args&... args) const {
    CHORUS_THROW(IOError, path_, ": ", args...);
  }

  void read_at(uint64_t pos, void* dst, uint64_t n, const char* what) {
    in_.seekg(static_cast<std::streamoff>(pos));
    in_.read(static_cast<char*>(dst), static_cast<std::streamsize>(n));
    if (!in_ || static_cast<uint64_t>(in_.gcount()) != n)
      fail("read of ", what, " (file bytes [", pos, ", ", pos + n, ")) failed: the file changed or is unreadable");
  }

  std::vector<Entry> parse_header(const std::string& text, std::map<std::string, std::string>* metadata) {
    if (auto at = detail::find_excess_nesting(text, kMaxHeaderDepth))
      fail("header nests deeper than ", kMaxHeaderDepth, " levels (at header byte ", *at, ", file byte ", 8 + *at,
           "); a safetensors header is an object of flat tensor entries");
    json header;
    try {
      header = json::parse(text);
    } catch (const json::parse_error& e) {
      fail("header (file bytes [8, ", data_start_, ")) is not valid JSON: error at header byte ", e.byte,
           ": ", e.what());
    } catch (const json::exception& e) {  // e.g. out_of_range: a number too large to hold
      fail("header (file bytes [8, ", data_start_, ")) is not valid JSON: ", e.what());
    }
    if (!header.is_object()) fail("header is JSON ", header.type_name(), ", expected an object");
    std::vector<Entry> entries;
    for (const auto& [name, info] : header.items()) {
      if (name == kMetadataKey) {
        parse_metadata(info, metadata);
        continue;
      }
      entries.push_back(parse_entry(name, info));
    }
    // File order: the order the writer chose, and sequential reads.
    std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
    });
    return entries;
  }

  void parse_metadata(const json& info, std::map<std::string, std::string>* metadata) {
    if (!info.is_object()) fail("header's \"", kMetadataKey, "\" is JSON ", info.type_name(), ", expected an object of strings");
    for (const auto& [k, v] : info.items()) {
      if (!v.is_string()) fail("metadata value \"", k, "\" is JSON ", v.type_name(), ", expected a string");
      if (metadata) (*metadata)[k] = v.get<std::string>();
    }
  }

  Entry parse_entry(const std::string& name, const json& info) {
    Entry e{name, kFloat32, {}, 0, 0};
    if (!info.is_object()) fail("tensor '", name, "': header entry is JSON ", info.type_name(), ", expected an object");
    auto field = [&](const char* key) -> const json& {
      auto it = info.find(key);
      if (it == info.end()) fail("tensor '", name, "': header entry has no \"", key, "\"");
      return *it;
    };
    const json& dtype = field("dtype");
    if (!dtype.is_string()) fail("tensor '", name, "': \"dtype\" is JSON ", dtype.type_name(), ", expected a string");
    if (!parse_safetensors_dtype(dtype.get<std::string>(), &e.dtype))
      fail("tensor '", name, "' has unknown dtype \"", dtype.get<std::string>(),
           "\" (supported: F32, BF16, F16, F64, I64, I32, U8, BOOL)");
    const json& shape = field("shape");
    if (!shape.is_array()) fail("tensor '", name, "': \"shape\" is JSON ", shape.type_name(), ", expected an array");
    // Element count, saturating: a product past the file size is an error below anyway.
    uint64_t numel = 1;
    for (const json& d : shape) {
      if (!d.is_number_unsigned()) fail("tensor '", name, "': shape ", detail::json_excerpt(shape), " has an entry that is not a non-negative integer");
      uint64_t v = d.get<uint64_t>();
      if (v > uint64_t(std::numeric_limits<int64_t>::max())) fail("tensor '", name, "': shape ", detail::json_excerpt(shape), " is too large");
      e.shape.push_back(static_cast<int64_t>(v));
      numel = (v != 0 && numel > std::numeric_limits<uint64_t>::max() / v) ? std::numeric_limits<uint64_t>::max() : numel * v;
    }
    const json& offsets = field("data_offsets");
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned())
      fail("tensor '", name, "': \"data_offsets\" is ", detail::json_excerpt(offsets), ", expected [begin, end] with non-negative integers");
    e.begin = offsets[0].get<uint64_t>();
    e.end = offsets[1].get<uint64_t>();
    if (e.end < e.begin) fail("tensor '", name, "': data_offsets [", e.begin, ", ", e.end, "] end before they begin");
    const uint64_t esize = dtype_size(e.dtype);
    const bool overflow = numel > std::numeric_limits<uint64_t>::max() / esize;
    if (overflow || numel * esize != e.end - e.begin)
      fail("tensor '", name, "': shape ", shape_str(e.shape), " of ", dtype.get<std::string>(), " needs ",
           overflow ? std::string("more than 2^64") : std::to_string(numel * esize), " bytes but data_offsets [",
           e.begin, ", ", e.end, "] span ", e.end - e.begin);
    return e;
  }

  // The tensors, in offset order, must cover [0, data_size) exactly once.
  void check_tiling(const std::vector<Entry>& entries) {
    uint64_t covered = 0;
    const Entry* prev = nullptr;
    for (const Entry& e : entries) {
      if (e.begin < covered)
        fail("tensors '", prev->name, "' (bytes [", prev->begin, ", ", prev->end, ")) and '", e.name, "' (bytes [",
             e.begin, ", ", e.end, ")) overlap in the data section");
      if (e.begin > covered)
        fail("bytes [", covered, ", ", e.begin, ") of the data section belong to no tensor (before '", e.name, "')");
      // Checked in file order, so a truncation names the first tensor it cut.
      if (e.end > data_size_)
        fail("tensor '", e.name, "' needs bytes [", e.begin, ", ", e.end, ") but the file's data section has ",
             data_size_, " bytes (file truncated?)");
      covered = e.end;
      // An empty tensor [x, x) does not move the frontier; keep the last real one for messages.
      if (e.end > e.begin || !prev) prev = &e;
    }
    if (covered != data_size_)
      fail("the data section has ", data_size_, " bytes but the tensors cover only [0, ", covered, "): ",
           data_size_ - covered, " trailing bytes at file offset ", data_start_ + covered);
  }

  Tensor read_tensor(const Entry& e) {
    Tensor t = chorus::detail::empty_tensor(e.shape, e.dtype, cpu_device(0));
    const uint64_t n = e.end - e.begin;
    if (n == 0) return t;
    const std::string what = "tensor '" + e.name + "'";
    read_at(data_start_ + e.begin, t.raw_data(), n, what.c_str());
    if (e.dtype == kBool) {
      // Any byte but 0 or 1 is not a bool; reading it as one is undefined.
      const uint8_t* b = static_cast<const uint8_t*>(t.raw_data());
      for (uint64_t i = 0; i < n; ++i)
        if (b[i] > 1)
          fail("tensor '", e.name, "' (BOOL) holds byte ", int(b[i]), " at file offset ", data_start_ + e.begin + i,
               "; booleans are 0 or 1");
    }
    return t;
  }

  std::string path_;
  std::ifstream in_;
  uint64_t file_size_ = 0;
  uint64_t data_start_ = 0;
  uint64_t data_size_ = 0;
};

}  // namespace

nn::NamedTensors load_safetensors(const std::string& path, std::map<std::string, std::string>* metadata) {
  std::map<std::string, std::string> meta;
  nn::NamedTensors out = Reader(path).read(&meta);
  // Only a fully valid file changes the caller's metadata.
  if (metadata) *metadata = std::move(meta);
  return out;
}

}  // namespace chorus::io
