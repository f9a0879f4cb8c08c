#include "chorus/io/sharded_index.h"

#include <algorithm>
#include <filesystem>
#include <limits>

#include "chorus/core/error.h"
#include "chorus/io/file_util.h"
#include "chorus/io/json_util.h"
#include "chorus/io/safetensors.h"

namespace chorus::io {

namespace {

using ijson = nlohmann::json;

// An index lists every piece of every tensor: a few hundred bytes per piece.
// These bounds only stop hostile files (Note [Untrusted JSON]).
constexpr int kMaxIndexDepth = 64;
constexpr uint64_t kMaxIndexBytes = 1u << 30;

ijson training_state_json(const TrainingState& s) {
  return {{"epoch", s.epoch},
          {"step", s.step},
          {"batch_in_epoch", s.batch_in_epoch},
          {"rng", {{"seed", s.rng.seed}, {"offset", s.rng.offset}}},
          {"config", s.config},
          {"extra", s.extra}};
}

// Field access that throws IOError "<path>: <where>..." for a missing or mistyped field.
class IndexParser {
 public:
  explicit IndexParser(const std::string& path) : path_(path) {}

  template <typename... Args>
  [[noreturn]] void fail(const Args&... args) const {
    CHORUS_THROW(IOError, path_, ": ", args...);
  }

  const ijson& field(const ijson& obj, const char* key, const std::string& where) const {
    if (!obj.is_object()) fail(where, "is ", detail::json_excerpt(obj), ", expected an object");
    auto it = obj.find(key);
    if (it == obj.end()) fail(where, "has no \"", key, "\"");
    return *it;
  }
  int64_t integer(const ijson& obj, const char* key, const std::string& where) const {
    const ijson& v = field(obj, key, where);
    if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX)) ||
        v.get<int64_t>() < 0)
      fail(where, "\"", key, "\" is ", detail::json_excerpt(v), ", expected a non-negative integer");
    return v.get<int64_t>();
  }
  uint64_t unsigned_integer(const ijson& obj, const char* key, const std::string& where) const {
    const ijson& v = field(obj, key, where);
    if (!v.is_number_unsigned()) fail(where, "\"", key, "\" is ", detail::json_excerpt(v), ", expected an unsigned integer");
    return v.get<uint64_t>();
  }
  std::string string(const ijson& obj, const char* key, const std::string& where) const {
    const ijson& v = field(obj, key, where);
    if (!v.is_string()) fail(where, "\"", key, "\" is ", detail::json_excerpt(v), ", expected a string");
    return v.get<std::string>();
  }
  const ijson& array(const ijson& obj, const char* key, const std::string& where) const {
    const ijson& v = field(obj, key, where);
    if (!v.is_array()) fail(where, "\"", key, "\" is ", detail::json_excerpt(v), ", expected an array");
    return v;
  }

  TrainingState state(const ijson& j) const {
    const std::string where = "\"state\" ";
    TrainingState s;
    s.epoch = integer(j, "epoch", where);
    s.step = integer(j, "step", where);
    s.batch_in_epoch = integer(j, "batch_in_epoch", where);
    const ijson& rng = field(j, "rng", where);
    s.rng.seed = unsigned_integer(rng, "seed", "\"state\" \"rng\" ");
    s.rng.offset = unsigned_integer(rng, "offset", "\"state\" \"rng\" ");
    if (j.contains("config")) s.config = j["config"];
    if (j.contains("extra")) s.extra = j["extra"];
    return s;
  }

  ShardedTensorInfo tensor(const ijson& j, size_t i) const {
    ShardedTensorInfo t;
    t.name = string(j, "name", "tensor " + std::to_string(i) + " ");
    const std::string where = "tensor '" + t.name + "' ";
    const std::string dtype = string(j, "dtype", where);
    if (!parse_safetensors_dtype(dtype, &t.dtype)) fail(where, "has unknown dtype \"", dtype, "\"");
    uint64_t numel = 1;
    for (const ijson& d : array(j, "shape", where)) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > uint64_t(INT64_MAX))
        fail(where, "shape ", detail::json_excerpt(j["shape"]), " has an entry that is not a non-negative integer");
      const uint64_t v = d.get<uint64_t>();
      if (v != 0 && numel > uint64_t(INT64_MAX) / v) fail(where, "shape ", detail::json_excerpt(j["shape"]), " is too large");
      numel *= v;
      t.shape.push_back(static_cast<int64_t>(v));
    }
    t.optimizer = string(j, "kind", where) == "optimizer";
    if (j.contains("param")) t.param = string(j, "param", where);
    if (j.contains("buffer")) t.buffer = string(j, "buffer", where);
    const ijson& pieces = array(j, "pieces", where);
    for (size_t k = 0; k < pieces.size(); ++k) {
      const std::string pw = where + "piece " + std::to_string(k) + " ";
      PieceRef p;
      p.file = string(pieces[k], "file", pw);
      p.key = string(pieces[k], "key", pw);
      p.begin = integer(pieces[k], "begin", pw);
      p.end = integer(pieces[k], "end", pw);
      if (pieces[k].contains("step")) p.step = integer(pieces[k], "step", pw);
      // A piece's file is a plain name inside the checkpoint: an index never
      // sends the reader elsewhere.
      if (p.file.empty() || p.file.find('/') != std::string::npos || p.file == "." || p.file == "..")
        fail(pw, "names file \"", p.file, "\", expected a file name inside the checkpoint directory");
      if (p.end < p.begin || static_cast<uint64_t>(p.end) > numel)
        fail(pw, "covers elements [", p.begin, ", ", p.end, ") of a tensor of ", numel, " elements");
      t.pieces.push_back(std::move(p));
    }
    check_pieces_tile(path_, t.name, static_cast<int64_t>(numel), t.pieces);
    return t;
  }

 private:
  const std::string& path_;
};

}  // namespace

nlohmann::json ShardedIndex::to_json() const {
  ijson ts = ijson::array();
  for (const ShardedTensorInfo& t : tensors) {
    ijson pieces = ijson::array();
    for (const PieceRef& p : t.pieces) {
      ijson pj = {{"file", p.file}, {"key", p.key}, {"begin", p.begin}, {"end", p.end}};
      if (p.step) pj["step"] = *p.step;
      pieces.push_back(std::move(pj));
    }
    ijson tj = {{"name", t.name},
                {"kind", t.optimizer ? "optimizer" : "model"},
                {"shape", t.shape},
                {"dtype", safetensors_dtype_name(t.dtype)},
                {"pieces", std::move(pieces)}};
    if (!t.param.empty()) tj["param"] = t.param;
    if (!t.buffer.empty()) tj["buffer"] = t.buffer;
    ts.push_back(std::move(tj));
  }
  return {{"format", "chorus-sharded-checkpoint"},
          {"format_version", kShardedCheckpointFormatVersion},
          {"world_size", world},
          {"layout", layout},
          {"optimizer", optimizer_name},
          {"param_order", param_order},
          {"state", training_state_json(state)},
          {"tensors", std::move(ts)}};
}

const ShardedTensorInfo* ShardedIndex::find(const std::string& name) const {
  for (const ShardedTensorInfo& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

void check_pieces_tile(const std::string& where, const std::string& name, int64_t numel,
                       const std::vector<PieceRef>& pieces) {
  std::vector<const PieceRef*> order;
  for (const PieceRef& p : pieces)
    if (p.end > p.begin) order.push_back(&p);
  std::sort(order.begin(), order.end(), [](const PieceRef* a, const PieceRef* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  int64_t covered = 0;
  const PieceRef* prev = nullptr;
  for (const PieceRef* p : order) {
    if (p->begin < covered)
      CHORUS_THROW(IOError, where, ": tensor '", name, "': pieces [", prev->begin, ", ", prev->end, ") (", prev->file,
                   ") and [", p->begin, ", ", p->end, ") (", p->file, ") overlap");
    if (p->begin > covered)
      CHORUS_THROW(IOError, where, ": tensor '", name, "': elements [", covered, ", ", p->begin, ") of ", numel,
                   " are in no piece (a shard is missing from the index)");
    covered = p->end;
    prev = p;
  }
  if (covered != numel)
    CHORUS_THROW(IOError, where, ": tensor '", name, "': elements [", covered, ", ", numel, ") of ", numel,
                 " are in no piece (a shard is missing from the index)");
}

ShardedIndex parse_sharded_index(const std::string& text, const std::string& path) {
  IndexParser p(path);
  if (auto at = detail::find_excess_nesting(text, kMaxIndexDepth))
    p.fail("JSON nests deeper than ", kMaxIndexDepth, " levels (at byte ", *at, ")");
  ijson j;
  try {
    j = ijson::parse(text);
  } catch (const ijson::parse_error& e) {
    p.fail("not valid JSON (error at byte ", e.byte, "): ", e.what());
  } catch (const ijson::exception& e) {
    p.fail("not valid JSON: ", e.what());
  }
  if (!j.is_object()) p.fail("expected a JSON object, got ", j.type_name());
  if (p.string(j, "format", "") != "chorus-sharded-checkpoint")
    p.fail("\"format\" is not \"chorus-sharded-checkpoint\": not a sharded checkpoint's index");
  const int64_t version = p.integer(j, "format_version", "");
  if (version != kShardedCheckpointFormatVersion)
    p.fail("sharded checkpoint format version ", version, ", this build reads version ", kShardedCheckpointFormatVersion);
  ShardedIndex idx;
  const int64_t world = p.integer(j, "world_size", "");
  if (world < 1 || world > (1 << 20)) p.fail("\"world_size\" is ", world, ", expected at least 1");
  idx.world = static_cast<int>(world);
  if (j.contains("layout")) idx.layout = j["layout"];
  if (j.contains("optimizer")) idx.optimizer_name = p.string(j, "optimizer", "");
  if (j.contains("param_order"))
    for (const ijson& n : p.array(j, "param_order", "")) {
      if (!n.is_string()) p.fail("\"param_order\" holds ", detail::json_excerpt(n), ", expected parameter names");
      idx.param_order.push_back(n.get<std::string>());
    }
  idx.state = p.state(p.field(j, "state", ""));
  const ijson& tensors = p.array(j, "tensors", "");
  for (size_t i = 0; i < tensors.size(); ++i) {
    idx.tensors.push_back(p.tensor(tensors[i], i));
    if (idx.find(idx.tensors.back().name) != &idx.tensors.back())
      p.fail("tensor '", idx.tensors.back().name, "' is listed twice");
  }
  return idx;
}

ShardedIndex read_sharded_index(const std::string& ckpt_dir) {
  const std::string path = (std::filesystem::path(ckpt_dir) / kShardedIndexFile).string();
  std::error_code ec;
  const uintmax_t size = std::filesystem::file_size(path, ec);
  if (!ec && size > kMaxIndexBytes)
    CHORUS_THROW(IOError, path, ": ", size, " bytes, more than an index can be (", kMaxIndexBytes, ")");
  if (!ec && !std::filesystem::is_regular_file(path, ec)) CHORUS_THROW(IOError, path, ": not a regular file");
  return parse_sharded_index(detail::read_file(path), path);
}

}  // namespace chorus::io
