#include "chorus/io/checkpoint.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <filesystem>
#include <vector>

#include "chorus/core/error.h"
#include "chorus/core/warn.h"
#include "chorus/io/file_util.h"
#include "chorus/io/json_util.h"
#include "chorus/io/safetensors.h"

namespace chorus::io {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kOptimizerFile = "optimizer.safetensors";
constexpr const char* kStateFile = "state.json";
constexpr const char* kLatestFile = "latest";
constexpr const char* kPrefix = "ckpt-";
// Hidden, and never parsed as a checkpoint: in-progress and crashed saves.
constexpr const char* kTmpPrefix = ".tmp-";
// state.json is a few hundred bytes; these bounds only stop hostile files
// (Note [Untrusted JSON]): the caller's config and extra may nest, not this deep.
constexpr int kMaxStateDepth = 64;
constexpr uint64_t kMaxStateBytes = 64u << 20;

// The step of a "ckpt-<digits>" name; nullopt for anything else.
std::optional<int64_t> parse_checkpoint_name(const std::string& name) {
  const std::string_view prefix = kPrefix;
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) return std::nullopt;
  int64_t step = 0;
  const char* b = name.data() + prefix.size();
  const char* e = name.data() + name.size();
  auto [ptr, ec] = std::from_chars(b, e, step);
  if (ec != std::errc() || ptr != e || step < 0) return std::nullopt;
  return step;
}

struct Found {
  int64_t step;
  fs::path path;
};

// Every "ckpt-<step>" directory in `dir`, complete or not.
std::vector<Found> list_checkpoints(const fs::path& dir) {
  std::vector<Found> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    auto step = parse_checkpoint_name(entry.path().filename().string());
    if (step && entry.is_directory(ec)) out.push_back({*step, entry.path()});
  }
  std::sort(out.begin(), out.end(), [](const Found& a, const Found& b) { return a.step > b.step; });
  return out;
}

// Why `p` is not a regular file, for messages: a FIFO would block a reader
// forever and a directory cannot be read, so neither is ever opened.
std::string not_a_file_because(const fs::path& p) {
  std::error_code ec;
  const fs::file_status link = fs::symlink_status(p, ec);
  if (ec && ec != std::errc::no_such_file_or_directory) return "cannot be inspected: " + ec.message();
  if (!fs::exists(link)) return "missing";
  const fs::file_status st = fs::status(p, ec);
  if (fs::is_symlink(link) && !fs::exists(st)) return "a dangling symbolic link";
  switch (st.type()) {
    case fs::file_type::directory: return "a directory, not a file";
    case fs::file_type::fifo: return "a FIFO, not a file";
    case fs::file_type::socket: return "a socket, not a file";
    case fs::file_type::block:
    case fs::file_type::character: return "a device, not a file";
    default: return "not a regular file";
  }
}

// Deletes older checkpoints and crash debris. The new checkpoint is already
// in place, so a failure here is reported and never loses it.
void prune(const fs::path& dir, int keep_last, const fs::path& current) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const bool debris = name.rfind(kTmpPrefix, 0) == 0 || name.rfind(std::string(kLatestFile) + ".tmp-", 0) == 0;
    if (debris && fs::remove_all(entry.path(), ec) == static_cast<std::uintmax_t>(-1))
      warn("cannot remove " + entry.path().string() + ": " + ec.message());
  }
  int kept = 0;
  for (const Found& f : list_checkpoints(dir)) {
    // An incomplete checkpoint is damage, not debris (saves are atomic): it
    // stays for the user to look at (Note [Unreadable checkpoints]).
    if (!is_complete_checkpoint(f.path.string())) continue;
    if (f.path == current || keep_last == 0 || kept < keep_last) {
      ++kept;
      continue;
    }
    // Note [Checkpoints removed whole] (io/file_util.h).
    if (const std::string err = detail::remove_directory_atomically(f.path.string(), kTmpPrefix); !err.empty())
      warn("cannot remove old checkpoint " + f.path.string() + ": " + err);
  }
}

json state_to_json(const TrainingState& s, const optim::Optimizer& optimizer) {
  return {{"format", "chorus-checkpoint"},
          {"format_version", kCheckpointFormatVersion},
          {"epoch", s.epoch},
          {"step", s.step},
          {"batch_in_epoch", s.batch_in_epoch},
          {"rng", {{"seed", s.rng.seed}, {"offset", s.rng.offset}}},
          {"optimizer", optimizer.name()},
          {"config", s.config},
          {"extra", s.extra}};
}

}  // namespace

TrainingState read_training_state(const std::string& path) {
  std::error_code ec;
  const uintmax_t size = fs::file_size(path, ec);
  if (!ec && size > kMaxStateBytes)
    CHORUS_THROW(IOError, path, ": ", size, " bytes, more than a state.json can be (", kMaxStateBytes, ")");
  const std::string text = detail::read_file(path);
  if (auto at = detail::find_excess_nesting(text, kMaxStateDepth))
    CHORUS_THROW(IOError, path, ": JSON nests deeper than ", kMaxStateDepth, " levels (at byte ", *at, ")");
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    CHORUS_THROW(IOError, path, ": not valid JSON (error at byte ", e.byte, "): ", e.what());
  } catch (const json::exception& e) {  // e.g. out_of_range: a number too large to hold
    CHORUS_THROW(IOError, path, ": not valid JSON: ", e.what());
  }
  if (!j.is_object()) CHORUS_THROW(IOError, path, ": expected a JSON object, got ", j.type_name());
  auto field = [&](const json& obj, const char* key, const char* where) -> const json& {
    auto it = obj.find(key);
    if (it == obj.end()) CHORUS_THROW(IOError, path, ": ", where, "has no \"", key, "\"");
    return *it;
  };
  auto integer = [&](const json& obj, const char* key, const char* where) -> int64_t {
    const json& v = field(obj, key, where);
    if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX)) ||
        v.get<int64_t>() < 0)
      CHORUS_THROW(IOError, path, ": ", where, "\"", key, "\" is ", detail::json_excerpt(v),
                   ", expected a non-negative integer");
    return v.get<int64_t>();
  };
  const int64_t version = integer(j, "format_version", "");
  if (version != kCheckpointFormatVersion)
    CHORUS_THROW(IOError, path, ": checkpoint format version ", version, ", this build reads version ",
                 kCheckpointFormatVersion);
  TrainingState s;
  s.epoch = integer(j, "epoch", "");
  s.step = integer(j, "step", "");
  s.batch_in_epoch = integer(j, "batch_in_epoch", "");
  const json& rng = field(j, "rng", "");
  if (!rng.is_object()) CHORUS_THROW(IOError, path, ": \"rng\" is ", detail::json_excerpt(rng), ", expected an object");
  for (const char* key : {"seed", "offset"}) {
    const json& v = field(rng, key, "\"rng\" ");
    if (!v.is_number_unsigned())
      CHORUS_THROW(IOError, path, ": \"rng\" \"", key, "\" is ", detail::json_excerpt(v),
                   ", expected an unsigned integer");
  }
  s.rng.seed = rng["seed"].get<uint64_t>();
  s.rng.offset = rng["offset"].get<uint64_t>();
  if (j.contains("config")) s.config = j["config"];
  if (j.contains("extra")) s.extra = j["extra"];
  return s;
}

std::string checkpoint_name(int64_t step) {
  std::string digits = std::to_string(step);
  return kPrefix + std::string(digits.size() < 8 ? 8 - digits.size() : 0, '0') + digits;
}

bool is_complete_checkpoint(const std::string& ckpt_dir) {
  std::error_code ec;
  for (const char* f : {kModelFile, kOptimizerFile, kStateFile})
    if (!fs::is_regular_file(fs::path(ckpt_dir) / f, ec)) return false;
  return true;
}

std::string save_checkpoint(const std::string& dir, const nn::Module& module, const optim::Optimizer& optimizer,
                            const TrainingState& state, int keep_last) {
  CHORUS_CHECK(state.step >= 0, "save_checkpoint: step must be >= 0, got ", state.step);
  CHORUS_CHECK(keep_last >= 0, "save_checkpoint: keep_last must be >= 0 (0 keeps all), got ", keep_last);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) CHORUS_THROW(IOError, dir, ": cannot create the checkpoint directory: ", ec.message());

  const std::string name = checkpoint_name(state.step);
  const fs::path final_path = fs::path(dir) / name;
  const fs::path tmp = fs::path(dir) / (kTmpPrefix + name + "-" + detail::unique_suffix());
  fs::path replaced;
  try {
    fs::create_directory(tmp, ec);
    if (ec) CHORUS_THROW(IOError, tmp.string(), ": cannot create: ", ec.message());
    save_safetensors((tmp / kModelFile).string(), module.state_dict(), {{"format", "pt"}, {"producer", "chorus"}});
    save_safetensors((tmp / kOptimizerFile).string(), optimizer.state(),
                     {{"optimizer", optimizer.name()}, {"producer", "chorus"}});
    detail::write_file_atomically((tmp / kStateFile).string(), state_to_json(state, optimizer).dump(2) + "\n");
    detail::fsync_directory(tmp.string());
    // rename() cannot replace a non-empty directory: move an existing
    // checkpoint of this step aside first (a crash in between leaves the
    // older checkpoints to fall back on).
    if (fs::exists(final_path, ec)) {
      replaced = fs::path(dir) / (kTmpPrefix + std::string("replaced-") + name + "-" + detail::unique_suffix());
      detail::rename_path(final_path.string(), replaced.string());
    }
    detail::rename_path(tmp.string(), final_path.string());
    detail::fsync_directory(dir);
  } catch (const IOError& e) {
    // A full disk, a file size limit (Note [File size limit] in apps/cli.cpp):
    // the half-written save goes, the checkpoints before it stay.
    fs::remove_all(tmp, ec);
    CHORUS_THROW(IOError, "cannot save checkpoint ", final_path.string(), ": ", e.message(),
                 replaced.empty() ? "; the checkpoints before it are intact" : "");
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  if (!replaced.empty()) fs::remove_all(replaced, ec);
  detail::write_file_atomically((fs::path(dir) / kLatestFile).string(), name + "\n");
  prune(dir, keep_last, final_path);
  return final_path.string();
}

std::optional<std::string> find_latest_checkpoint(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return std::nullopt;
  const fs::path latest = fs::path(dir) / kLatestFile;
  if (fs::is_regular_file(latest, ec)) {
    try {
      std::string name = detail::read_file(latest.string());
      while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) name.pop_back();
      // Only a bare checkpoint name: `latest` never sends us outside `dir`.
      if (parse_checkpoint_name(name) && is_complete_checkpoint((fs::path(dir) / name).string()))
        return (fs::path(dir) / name).string();
    } catch (const IOError&) {
      // Unreadable pointer: fall back to scanning, as for a missing one.
    }
  }
  for (const Found& f : list_checkpoints(dir))
    if (is_complete_checkpoint(f.path.string())) return f.path.string();
  return std::nullopt;
}

namespace {

// Moves a checkpoint that could not be read out of the names that pruning
// and saving manage. Returns the new path, or "" (with a warning) when the
// rename fails: the checkpoint then stays where it was.
std::string set_aside(const fs::path& ckpt) {
  fs::path to = ckpt.string() + ".unreadable";
  std::error_code ec;
  if (fs::exists(fs::symlink_status(to, ec))) to = ckpt.string() + ".unreadable-" + detail::unique_suffix();
  try {
    detail::rename_path(ckpt.string(), to.string());
  } catch (const IOError& e) {
    warn(e.message());
    return "";
  }
  return to.string();
}

}  // namespace

namespace {
// Marks an exception from the caller's check so that resume does not take it for an unreadable file.
struct CheckFailed {
  std::exception_ptr error;
};
}  // namespace

Resumed resume_checkpoint(const std::string& dir, nn::Module& module, optim::Optimizer& optimizer,
                          bool allow_fresh_start,
                          const std::function<void(const TrainingState&, const std::string&)>& check) {
  Resumed out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  // `latest` first (it may name an older checkpoint on purpose), then by step.
  std::vector<fs::path> candidates;
  try {
    std::string name = detail::read_file((fs::path(dir) / kLatestFile).string());
    while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) name.pop_back();
    if (parse_checkpoint_name(name) && fs::is_directory(fs::path(dir) / name, ec))
      candidates.push_back(fs::path(dir) / name);
  } catch (const IOError&) {
    // No or unreadable pointer: the scan below finds the same checkpoints.
  }
  for (const Found& f : list_checkpoints(dir))
    if (candidates.empty() || f.path != candidates[0]) candidates.push_back(f.path);

  for (const fs::path& c : candidates) {
    try {
      auto guarded = [&](const TrainingState& st, const std::string& path) {
        if (!check) return;
        try {
          check(st, path);
        } catch (...) {
          throw CheckFailed{std::current_exception()};
        }
      };
      out.state = load_checkpoint(c.string(), module, optimizer, guarded);
      out.path = c.string();
      break;
    } catch (const IOError& e) {
      out.skipped.push_back({c.string(), e.message(), ""});
    } catch (const CheckFailed& f) {
      std::rethrow_exception(f.error);
    }
  }
  if (!out.path && !out.skipped.empty() && !allow_fresh_start) {
    std::string list;
    for (const SkippedCheckpoint& s : out.skipped) list += (list.empty() ? "" : "; ") + s.reason;
    CHORUS_THROW(IOError, dir, ": no checkpoint could be read (", out.skipped.size(), " tried, none changed): ", list);
  }
  for (SkippedCheckpoint& s : out.skipped) s.kept_as = set_aside(s.path);
  return out;
}

TrainingState load_checkpoint(const std::string& ckpt_dir, nn::Module& module, optim::Optimizer& optimizer,
                              const std::function<void(const TrainingState&, const std::string&)>& check) {
  const fs::path dir(ckpt_dir);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) CHORUS_THROW(IOError, ckpt_dir, ": not a checkpoint directory");
  for (const char* f : {kStateFile, kModelFile, kOptimizerFile})
    if (!fs::is_regular_file(dir / f, ec))
      CHORUS_THROW(IOError, (dir / f).string(), ": ", not_a_file_because(dir / f), "; ", ckpt_dir,
                   " is not a complete checkpoint");

  // Read and validate every file before touching the module or optimizer.
  const std::string state_path = (dir / kStateFile).string();
  const std::string model_path = (dir / kModelFile).string();
  const std::string optim_path = (dir / kOptimizerFile).string();
  TrainingState state = read_training_state(state_path);
  if (check) check(state, state_path);
  nn::NamedTensors weights = load_safetensors(model_path);
  std::map<std::string, std::string> optim_meta;
  nn::NamedTensors optim_state = load_safetensors(optim_path, &optim_meta);
  auto it = optim_meta.find("optimizer");
  CHORUS_CHECK(it == optim_meta.end() || it->second == optimizer.name(), optim_path, ": holds ", it->second,
               " state but the optimizer is ", optimizer.name());

  try {
    module.load_state_dict(weights);
  } catch (const ValueError& e) {
    CHORUS_THROW(ValueError, model_path, ": ", e.message());
  }
  try {
    optimizer.load_state(optim_state);
  } catch (const ValueError& e) {
    CHORUS_THROW(ValueError, optim_path, ": ", e.message());
  }
  return state;
}

}  // namespace chorus::io
