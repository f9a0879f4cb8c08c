#include "chorus/io/sharded_reader.h"

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "chorus/core/error.h"
#include "chorus/io/safetensors.h"
#include "chorus/io/sharded_checkpoint.h"

namespace chorus::io {

namespace {

namespace rfs = std::filesystem;

// A scalar int64 tensor on the host: an optimizer's per-parameter step count.
Tensor int64_scalar(int64_t v) {
  Tensor t = chorus::detail::empty_tensor(Shape{}, kInt64, cpu_device(0));
  *t.data<int64_t>() = v;
  return t;
}

}  // namespace

ShardedCheckpoint ShardedCheckpoint::open(const std::string& path) {
  std::error_code ec;
  if (!rfs::is_directory(path, ec)) CHORUS_THROW(IOError, path, ": no such directory (expected a sharded checkpoint)");
  std::string dir = path;
  if (!rfs::exists(rfs::path(path) / kShardedIndexFile, ec)) {
    auto latest = find_latest_sharded_checkpoint(path);
    if (!latest)
      CHORUS_THROW(IOError, path, ": not a sharded checkpoint (no ", kShardedIndexFile,
                   ") and holds no complete one (ckpt-<step>/", kShardedIndexFile, ")");
    dir = *latest;
  }
  ShardedIndex index = read_sharded_index(dir);
  for (const ShardedTensorInfo& t : index.tensors)
    for (const PieceRef& p : t.pieces) {
      const rfs::path f = rfs::path(dir) / p.file;
      if (!rfs::is_regular_file(f, ec))
        CHORUS_THROW(IOError, f.string(), ": missing (or not a file), but the index holds tensor '", t.name,
                     "' elements [", p.begin, ", ", p.end, ") there; ", dir, " is incomplete");
    }
  return ShardedCheckpoint(dir, std::move(index));
}

std::vector<std::string> ShardedCheckpoint::names() const {
  std::vector<std::string> out;
  for (const ShardedTensorInfo& t : index_.tensors) out.push_back(t.name);
  return out;
}

const ShardedTensorInfo& ShardedCheckpoint::info(const std::string& name) const {
  const ShardedTensorInfo* t = index_.find(name);
  CHORUS_CHECK(t, "sharded checkpoint ", path_, " has no tensor '", name, "'");
  return *t;
}

const Tensor& ShardedCheckpoint::piece_values(const ShardedTensorInfo& t, const PieceRef& p) const {
  auto it = cache_.find(p.file);
  const std::string file = (rfs::path(path_) / p.file).string();
  if (it == cache_.end()) {
    std::map<std::string, Tensor> tensors;
    for (auto& [key, v] : load_safetensors(file)) tensors.emplace(key, std::move(v));
    it = cache_.emplace(p.file, std::move(tensors)).first;
  }
  auto v = it->second.find(p.key);
  if (v == it->second.end())
    CHORUS_THROW(IOError, file, ": has no tensor '", p.key, "', which the index says holds '", t.name,
                 "' elements [", p.begin, ", ", p.end, ")");
  const int64_t n = p.end - p.begin;
  // Replicated tensors keep their shape in the file; pieces are 1-d.
  if (v->second.numel() != n || v->second.dtype() != t.dtype)
    CHORUS_THROW(IOError, file, ": tensor '", p.key, "' is ", v->second.describe(), ", but the index says it holds ",
                 n, " elements of ", dtype_name(t.dtype), " ('", t.name, "' [", p.begin, ", ", p.end, "))");
  return v->second;
}

Tensor ShardedCheckpoint::read(const std::string& name, int64_t begin, int64_t end) const {
  const ShardedTensorInfo& t = info(name);
  const int64_t numel = numel_of(t.shape);
  CHORUS_CHECK(0 <= begin && begin <= end && end <= numel, "sharded checkpoint ", path_, ": cannot read elements [",
               begin, ", ", end, ") of '", name, "', which has ", numel);
  Tensor out = chorus::detail::empty_tensor(Shape{end - begin}, t.dtype, cpu_device(0));
  const size_t esize = dtype_size(t.dtype);
  auto* dst = static_cast<uint8_t*>(out.raw_data());
  // The index tiles [0, numel) (checked when opened), so the overlaps fill `out`.
  for (const PieceRef& p : t.pieces) {
    const int64_t lo = std::max(begin, p.begin), hi = std::min(end, p.end);
    if (lo >= hi) continue;
    const Tensor& src = piece_values(t, p);
    std::memcpy(dst + (lo - begin) * esize, static_cast<const uint8_t*>(src.raw_data()) + (lo - p.begin) * esize,
                static_cast<size_t>(hi - lo) * esize);
  }
  return out;
}

Tensor ShardedCheckpoint::read_full(const std::string& name) const {
  const ShardedTensorInfo& t = info(name);
  return read(name, 0, numel_of(t.shape)).view(t.shape);
}

int64_t ShardedCheckpoint::read_step(const std::string& name, int64_t begin, int64_t end) const {
  const ShardedTensorInfo& t = info(name);
  std::optional<int64_t> step;
  for (const PieceRef& p : t.pieces) {
    // An empty range takes the count of the piece it starts in (or of any empty piece).
    const bool overlaps = begin < end ? (p.begin < end && begin < p.end) : (p.begin <= begin && begin <= p.end);
    if (!overlaps || !p.step) continue;
    if (step && *step != *p.step)
      CHORUS_THROW(IOError, path_, ": '", name, "' elements [", begin, ", ", end, ") span pieces with step counts ",
                   *step, " and ", *p.step, " (", p.file, ")");
    step = p.step;
  }
  CHORUS_CHECK(step, "sharded checkpoint ", path_, ": '", name, "' records no step count for elements [", begin, ", ",
               end, ")");
  return *step;
}

nn::NamedTensors load_full_model_state(const ShardedCheckpoint& ckpt) {
  nn::NamedTensors out;
  for (const ShardedTensorInfo& t : ckpt.index().tensors)
    if (!t.optimizer) out.emplace_back(t.name, ckpt.read_full(t.name));
  return out;
}

nn::NamedTensors load_full_optimizer_state(const ShardedCheckpoint& ckpt) {
  const ShardedIndex& idx = ckpt.index();
  nn::NamedTensors out;
  std::map<size_t, int64_t> steps;  // parameter position -> its step count
  const std::string prefix = kOptimizerNamePrefix;
  for (const ShardedTensorInfo& t : idx.tensors) {
    if (!t.optimizer) continue;
    if (t.param.empty()) {  // the optimizer's own scalars: "optimizer/step" -> "step"
      out.emplace_back(t.name.substr(prefix.size()), ckpt.read_full(t.name));
      continue;
    }
    auto it = std::find(idx.param_order.begin(), idx.param_order.end(), t.param);
    CHORUS_CHECK(it != idx.param_order.end(), "sharded checkpoint ", ckpt.path(), ": optimizer state '", t.name,
                 "' belongs to parameter '", t.param, "', which is not in the index's param_order");
    const size_t i = static_cast<size_t>(it - idx.param_order.begin());
    out.emplace_back("param." + std::to_string(i) + "." + t.buffer, ckpt.read_full(t.name));
    steps[i] = ckpt.read_step(t.name, 0, numel_of(t.shape));
  }
  for (const auto& [i, step] : steps) out.emplace_back("param." + std::to_string(i) + ".step", int64_scalar(step));
  return out;
}

}  // namespace chorus::io
