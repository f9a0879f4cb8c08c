// Writing a sharded checkpoint's files and committing it on disk, finding the
// newest complete one, pruning; the store protocol between ranks is in
// sharded_store_commit.cpp.
#include "chorus/io/sharded_checkpoint.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <filesystem>
#include <map>
#include <set>

#include "chorus/core/error.h"
#include "chorus/core/warn.h"
#include "chorus/io/file_util.h"
#include "chorus/io/safetensors.h"
#include "chorus/io/sharded_write.h"

namespace chorus::io {

namespace {

namespace sfs = std::filesystem;
using sjson = nlohmann::json;

// Hidden, and never parsed as a checkpoint (as in io/checkpoint.cpp).
constexpr const char* kShardedTmpPrefix = ".tmp-";
constexpr const char* kShardedLatest = "latest";

std::optional<int64_t> sharded_step_of(const std::string& name) {
  const std::string_view prefix = "ckpt-";
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) return std::nullopt;
  int64_t step = 0;
  const char* b = name.data() + prefix.size();
  const char* e = name.data() + name.size();
  auto [ptr, ec] = std::from_chars(b, e, step);
  if (ec != std::errc() || ptr != e || step < 0) return std::nullopt;
  return step;
}

// Every "ckpt-<step>" directory of `dir`, newest first, complete or not.
std::vector<std::pair<int64_t, sfs::path>> sharded_candidates(const sfs::path& dir) {
  std::vector<std::pair<int64_t, sfs::path>> out;
  std::error_code ec;
  for (const auto& entry : sfs::directory_iterator(dir, ec)) {
    auto step = sharded_step_of(entry.path().filename().string());
    if (step && entry.is_directory(ec)) out.emplace_back(*step, entry.path());
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return out;
}

// Deletes crash debris and all but the newest `keep_last` complete
// checkpoints of either format. The new checkpoint is in place already, so a
// failure here is a warning.
void prune_sharded(const sfs::path& dir, int keep_last, const sfs::path& current) {
  std::error_code ec;
  for (const auto& entry : sfs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const bool debris = name.rfind(kShardedTmpPrefix, 0) == 0 || name.rfind(std::string(kShardedLatest) + ".tmp-", 0) == 0;
    if (debris && sfs::remove_all(entry.path(), ec) == static_cast<std::uintmax_t>(-1))
      warn("cannot remove " + entry.path().string() + ": " + ec.message());
  }
  int kept = 0;
  for (const auto& [step, path] : sharded_candidates(dir)) {
    // Incomplete is damage, not debris (Note [Unreadable checkpoints]): kept.
    if (!is_complete_sharded_checkpoint(path.string()) && !is_complete_checkpoint(path.string())) continue;
    if (path == current || keep_last == 0 || kept < keep_last) {
      ++kept;
      continue;
    }
    // Note [Checkpoints removed whole] (io/file_util.h).
    if (const std::string err = detail::remove_directory_atomically(path.string(), kShardedTmpPrefix); !err.empty())
      warn("cannot remove old checkpoint " + path.string() + ": " + err);
  }
}

sjson shape_json(const Shape& s) { return sjson(s); }

Shape shape_from_json(const sjson& j) { return j.get<Shape>(); }

// A piece's values, checked against what it claims to be.
void check_piece(int rank, const std::string& name, const Shape& shape, DType dtype, int64_t begin, int64_t end,
                 const Tensor& values) {
  const int64_t numel = numel_of(shape);
  CHORUS_CHECK(begin >= 0 && begin <= end && end <= numel, "sharded checkpoint, rank ", rank, ": piece '", name,
               "' covers elements [", begin, ", ", end, ") of a tensor of shape ", shape_str(shape), " (", numel,
               " elements)");
  CHORUS_CHECK(values.defined(), "sharded checkpoint, rank ", rank, ": piece '", name, "' has no values");
  CHORUS_CHECK(values.dim() == 1 && values.numel() == end - begin && values.dtype() == dtype,
               "sharded checkpoint, rank ", rank, ": piece '", name, "' [", begin, ", ", end, ") needs ",
               dtype_name(dtype), "[", end - begin, "] values, got ", values.describe());
}

}  // namespace

std::string shard_file_name(int rank, int world) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "shard-%05d-of-%05d.safetensors", rank, world);
  return buf;
}

std::pair<int64_t, int64_t> even_range(int64_t numel, int rank, int world) {
  CHORUS_CHECK(world >= 1 && rank >= 0 && rank < world, "even_range: rank ", rank, " of a world of ", world);
  const int64_t base = numel / world, extra = numel % world;
  const int64_t begin = rank * base + std::min<int64_t>(rank, extra);
  return {begin, begin + base + (rank < extra ? 1 : 0)};
}

ShardedSave shard_full_state(const nn::NamedTensors& model_state, const nn::NamedTensors& optimizer_state,
                             const std::vector<std::string>& param_order, int rank, int world) {
  ShardedSave s;
  s.param_order = param_order;
  auto piece_of = [&](const Tensor& t) {
    const auto [b, e] = even_range(t.numel(), rank, world);
    return std::make_pair(std::make_pair(b, e), t.detach().contiguous().reshape({t.numel()}).narrow(0, b, e - b));
  };
  for (const auto& [name, t] : model_state) {
    auto [range, values] = piece_of(t);
    s.model.push_back({name, t.sizes(), t.dtype(), range.first, range.second, values});
  }
  // "param.<i>.step" and "param.<i>.<buffer>" -> one OptimizerPiece per parameter.
  std::map<size_t, OptimizerPiece> per_param;
  for (const auto& [name, t] : optimizer_state) {
    if (name.rfind("param.", 0) != 0) {
      s.replicated_optimizer.emplace_back(name, t);
      continue;
    }
    const size_t dot = name.find('.', 6);
    size_t i = 0;
    auto [ptr, ec] = std::from_chars(name.data() + 6, name.data() + (dot == std::string::npos ? name.size() : dot), i);
    CHORUS_CHECK(dot != std::string::npos && ec == std::errc() && ptr == name.data() + dot && i < param_order.size(),
                 "shard_full_state: optimizer state '", name, "' is not \"param.<i>.<buffer>\" with i < ",
                 param_order.size());
    OptimizerPiece& p = per_param[i];
    const std::string buffer = name.substr(dot + 1);
    if (buffer == "step") {
      p.step = static_cast<int64_t>(t.item());
      continue;
    }
    auto [range, values] = piece_of(t);
    p.param = param_order[i];
    p.shape = t.sizes();
    p.begin = range.first;
    p.end = range.second;
    p.buffers.emplace_back(buffer, values);
  }
  for (auto& [i, p] : per_param)
    if (!p.buffers.empty()) s.optimizer.push_back(std::move(p));
  return s;
}

namespace detail {

std::string make_sharded_tmp_dir(const std::string& dir, int64_t step) {
  std::error_code ec;
  sfs::create_directories(dir, ec);
  if (ec) CHORUS_THROW(IOError, dir, ": cannot create the checkpoint directory: ", ec.message());
  const sfs::path tmp = sfs::path(dir) / (kShardedTmpPrefix + checkpoint_name(step) + "-" + unique_suffix());
  sfs::create_directory(tmp, ec);
  if (ec) CHORUS_THROW(IOError, tmp.string(), ": cannot create: ", ec.message());
  return tmp.string();
}

nlohmann::json write_rank_shard(const std::string& tmp_dir, int rank, int world, const ShardedSave& save) {
  const std::string file = shard_file_name(rank, world);
  nn::NamedTensors tensors;
  sjson described = sjson::array();
  std::set<std::string> seen;
  auto add = [&](sjson d, const Tensor& values) {
    const std::string name = d["name"].get<std::string>();
    CHORUS_CHECK(seen.insert(name).second, "sharded checkpoint, rank ", rank, ": piece '", name,
                 "' is given twice (a rank holds one range of each tensor)");
    tensors.emplace_back(name, values);
    described.push_back(std::move(d));
  };
  for (const ShardPiece& p : save.model) {
    CHORUS_CHECK(!p.name.empty() && p.name.rfind(kOptimizerNamePrefix, 0) != 0, "sharded checkpoint, rank ", rank,
                 ": model piece name '", p.name, "' is empty or starts with '", kOptimizerNamePrefix,
                 "' (reserved for optimizer state)");
    check_piece(rank, p.name, p.shape, p.dtype, p.begin, p.end, p.values);
    add({{"name", p.name}, {"kind", "model"}, {"shape", shape_json(p.shape)}, {"dtype", safetensors_dtype_name(p.dtype)},
         {"begin", p.begin}, {"end", p.end}},
        p.values);
  }
  for (const OptimizerPiece& p : save.optimizer) {
    for (const auto& [buffer, values] : p.buffers) {
      const std::string name = kOptimizerNamePrefix + p.param + "." + buffer;
      CHORUS_CHECK(values.defined(), "sharded checkpoint, rank ", rank, ": optimizer piece '", name, "' has no values");
      check_piece(rank, name, p.shape, values.dtype(), p.begin, p.end, values);
      add({{"name", name}, {"kind", "optimizer"}, {"param", p.param}, {"buffer", buffer},
           {"shape", shape_json(p.shape)}, {"dtype", safetensors_dtype_name(values.dtype())}, {"begin", p.begin},
           {"end", p.end}, {"step", p.step}},
          values);
    }
  }
  save_safetensors((sfs::path(tmp_dir) / file).string(), tensors,
                   {{"producer", "chorus"}, {"rank", std::to_string(rank)}, {"world", std::to_string(world)}});
  return {{"file", file}, {"tensors", std::move(described)}};
}

void write_replicated(const std::string& tmp_dir, const ShardedSave& rank0) {
  nn::NamedTensors tensors = rank0.replicated_model;
  for (const auto& [name, t] : rank0.replicated_optimizer) tensors.emplace_back(kOptimizerNamePrefix + name, t);
  save_safetensors((sfs::path(tmp_dir) / kReplicatedFile).string(), tensors, {{"producer", "chorus"}});
}

ShardedIndex build_sharded_index(const std::vector<nlohmann::json>& ranks, const ShardedSave& rank0, int world) {
  ShardedIndex idx;
  idx.world = world;
  idx.layout = rank0.layout;
  idx.optimizer_name = rank0.optimizer_name;
  idx.param_order = rank0.param_order;
  idx.state = rank0.state;
  std::map<std::string, size_t> where;  // name -> position in idx.tensors
  std::map<std::string, int> first_rank;
  auto entry = [&](const std::string& name, const Shape& shape, DType dtype, bool optimizer, int rank) -> ShardedTensorInfo& {
    auto [it, fresh] = where.emplace(name, idx.tensors.size());
    if (fresh) {
      idx.tensors.push_back({name, shape, dtype, optimizer, "", "", {}});
      first_rank[name] = rank;
    }
    ShardedTensorInfo& t = idx.tensors[it->second];
    CHORUS_CHECK(t.shape == shape && t.dtype == dtype && t.optimizer == optimizer, "sharded checkpoint: tensor '",
                 name, "' is ", dtype_name(t.dtype), shape_str(t.shape), " on rank ", first_rank[name], " but ",
                 dtype_name(dtype), shape_str(shape), rank < 0 ? " among rank 0's replicated tensors" : " on rank " + std::to_string(rank));
    return t;
  };
  for (int r = 0; r < world; ++r) {
    const sjson& d = ranks.at(r);
    const std::string file = d.at("file").get<std::string>();
    for (const sjson& p : d.at("tensors")) {
      DType dtype;
      CHORUS_ASSERT(parse_safetensors_dtype(p.at("dtype").get<std::string>(), &dtype));
      const std::string name = p.at("name").get<std::string>();
      ShardedTensorInfo& t = entry(name, shape_from_json(p.at("shape")), dtype, p.at("kind") == "optimizer", r);
      if (p.contains("param")) t.param = p["param"].get<std::string>();
      if (p.contains("buffer")) t.buffer = p["buffer"].get<std::string>();
      PieceRef ref{file, name, p.at("begin").get<int64_t>(), p.at("end").get<int64_t>(), std::nullopt};
      if (p.contains("step")) ref.step = p["step"].get<int64_t>();
      t.pieces.push_back(std::move(ref));
    }
  }
  auto replicated = [&](const std::string& name, const Tensor& v, bool optimizer) {
    CHORUS_CHECK(!where.count(name), "sharded checkpoint: '", name, "' is both a replicated tensor and a sharded one");
    entry(name, v.sizes(), v.dtype(), optimizer, -1).pieces.push_back({kReplicatedFile, name, 0, v.numel(), std::nullopt});
  };
  for (const auto& [name, t] : rank0.replicated_model) replicated(name, t, false);
  for (const auto& [name, t] : rank0.replicated_optimizer) replicated(kOptimizerNamePrefix + name, t, true);
  for (const ShardedTensorInfo& t : idx.tensors) {
    try {
      check_pieces_tile("sharded checkpoint", t.name, numel_of(t.shape), t.pieces);
    } catch (const IOError& e) {
      // At save time a gap or an overlap is the caller's ranges, not a file.
      CHORUS_THROW(ValueError, e.message(), " (the ranks' ranges must tile each tensor)");
    }
  }
  return idx;
}

std::string commit_sharded_checkpoint(const std::string& dir, const std::string& tmp_dir, const ShardedIndex& index,
                                      int keep_last) {
  const std::string name = checkpoint_name(index.state.step);
  const sfs::path final_path = sfs::path(dir) / name;
  sfs::path replaced;
  std::error_code ec;
  try {
    // Written last: its presence is what makes the checkpoint complete.
    write_file_atomically((sfs::path(tmp_dir) / kShardedIndexFile).string(), index.to_json().dump(1) + "\n");
    fsync_directory(tmp_dir);
    // rename() cannot replace a non-empty directory: an older save of this
    // step moves aside first (a crash in between leaves the ones before).
    if (sfs::exists(final_path, ec)) {
      replaced = sfs::path(dir) / (kShardedTmpPrefix + std::string("replaced-") + name + "-" + unique_suffix());
      rename_path(final_path.string(), replaced.string());
    }
    rename_path(tmp_dir, final_path.string());
    fsync_directory(dir);
  } catch (const IOError& e) {
    sfs::remove_all(tmp_dir, ec);
    CHORUS_THROW(IOError, "cannot save checkpoint ", final_path.string(), ": ", e.message(),
                 replaced.empty() ? "; the checkpoints before it are intact" : "");
  } catch (...) {
    sfs::remove_all(tmp_dir, ec);
    throw;
  }
  if (!replaced.empty()) sfs::remove_all(replaced, ec);
  write_file_atomically((sfs::path(dir) / kShardedLatest).string(), name + "\n");
  prune_sharded(dir, keep_last, final_path);
  return final_path.string();
}

}  // namespace detail

std::string save_sharded_checkpoint_from_one_process(const std::string& dir, const std::vector<ShardedSave>& saves,
                                                     int keep_last) {
  CHORUS_CHECK(!saves.empty(), "save_sharded_checkpoint_from_one_process: no ranks to save");
  CHORUS_CHECK(keep_last >= 0, "save_sharded_checkpoint: keep_last must be >= 0 (0 keeps all), got ", keep_last);
  CHORUS_CHECK(saves[0].state.step >= 0, "save_sharded_checkpoint: step must be >= 0, got ", saves[0].state.step);
  const int world = static_cast<int>(saves.size());
  const std::string tmp = detail::make_sharded_tmp_dir(dir, saves[0].state.step);
  ShardedIndex index;
  try {
    std::vector<sjson> described;
    for (int r = 0; r < world; ++r) described.push_back(detail::write_rank_shard(tmp, r, world, saves[r]));
    detail::write_replicated(tmp, saves[0]);
    index = detail::build_sharded_index(described, saves[0], world);
  } catch (...) {
    std::error_code ec;
    sfs::remove_all(tmp, ec);
    throw;
  }
  return detail::commit_sharded_checkpoint(dir, tmp, index, keep_last);
}

bool is_complete_sharded_checkpoint(const std::string& ckpt_dir) {
  try {
    const ShardedIndex idx = read_sharded_index(ckpt_dir);
    std::error_code ec;
    for (const ShardedTensorInfo& t : idx.tensors)
      for (const PieceRef& p : t.pieces)
        if (!sfs::is_regular_file(sfs::path(ckpt_dir) / p.file, ec)) return false;
    return true;
  } catch (const IOError&) {
    return false;
  }
}

std::optional<std::string> find_latest_sharded_checkpoint(const std::string& dir) {
  std::error_code ec;
  if (!sfs::is_directory(dir, ec)) return std::nullopt;
  try {
    std::string name = detail::read_file((sfs::path(dir) / kShardedLatest).string());
    while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) name.pop_back();
    // Only a bare checkpoint name: `latest` never sends us outside `dir`.
    if (sharded_step_of(name) && is_complete_sharded_checkpoint((sfs::path(dir) / name).string()))
      return (sfs::path(dir) / name).string();
  } catch (const IOError&) {
    // No or unreadable pointer: the scan finds the same checkpoints.
  }
  for (const auto& [step, path] : sharded_candidates(dir))
    if (is_complete_sharded_checkpoint(path.string())) return path.string();
  return std::nullopt;
}

}  // namespace chorus::io
