// save_sharded_checkpoint: the ranks of one job agree on a temp directory,
// write their shards into it and let rank 0 commit, through the job's store
// (Note [Sharded commit] in io/sharded_checkpoint.h).
//
// Keys, under "<key_prefix>/ckpt-<step>/":
//   dir       rank 0: the temp directory's name ("" when rank 0 failed first)
//   rank/<r>  rank r: {"ok": true, "shard": <write_rank_shard's description>}
//             or {"ok": false, "error": "..."}
//   done      how many ranks have set rank/<r> (store->add)
//   result    rank 0: "ok <path>" or "error <message>"
// They stay in the store: a few hundred bytes per rank and save.
#include <filesystem>
#include <thread>

#include "chorus/core/error.h"
#include "chorus/io/sharded_checkpoint.h"
#include "chorus/io/sharded_write.h"

namespace chorus::io {

namespace {

namespace cfs = std::filesystem;
using cjson = nlohmann::json;
using Clock = std::chrono::steady_clock;

class CommitKeys {
 public:
  CommitKeys(const std::string& prefix, int64_t step) : base_(prefix + "/" + checkpoint_name(step) + "/") {}
  std::string dir() const { return base_ + "dir"; }
  std::string rank(int r) const { return base_ + "rank/" + std::to_string(r); }
  std::string done() const { return base_ + "done"; }
  std::string result() const { return base_ + "result"; }

 private:
  std::string base_;
};

double seconds(std::chrono::milliseconds ms) { return static_cast<double>(ms.count()) / 1000.0; }

// Rank 0: every rank's description, or IOError naming the ranks that failed
// or did not report within `timeout`.
std::vector<cjson> collect_ranks(CommitStore& store, const CommitKeys& keys, int world, cjson own,
                                 std::chrono::milliseconds timeout, const std::string& name) {
  const auto deadline = Clock::now() + timeout;
  // One counter read per poll, however many ranks; the keys are read once all arrived.
  while (store.add(keys.done(), 0) < world - 1) {
    if (Clock::now() >= deadline) {
      std::string missing;
      for (int r = 1; r < world; ++r)
        if (!store.check({keys.rank(r)})) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      CHORUS_THROW(IOError, "timed out after ", seconds(timeout), " s waiting for rank(s) ", missing,
                   " to write their shards of ", name);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::vector<cjson> out{std::move(own)};
  for (int r = 1; r < world; ++r) {
    cjson d;
    try {
      d = cjson::parse(store.get(keys.rank(r)));
    } catch (const cjson::exception& e) {
      CHORUS_THROW(IOError, "rank ", r, "'s report on its shard of ", name, " is not valid JSON: ", e.what());
    }
    if (!d.value("ok", false))
      CHORUS_THROW(IOError, "rank ", r, " could not write its shard of ", name, ": ", d.value("error", "(no reason given)"));
    out.push_back(std::move(d["shard"]));
  }
  return out;
}

std::string rank0_save(const std::string& dir, const ShardedSave& save, const ShardedSaveOptions& o,
                       const CommitKeys& keys) {
  const std::string name = checkpoint_name(save.state.step);
  std::string tmp;
  try {
    tmp = detail::make_sharded_tmp_dir(dir, save.state.step);
  } catch (const Error& e) {
    if (o.store) {
      o.store->set(keys.dir(), std::string());
      o.store->set(keys.result(), "error " + e.message());
    }
    throw;
  }
  if (o.store) o.store->set(keys.dir(), cfs::path(tmp).filename().string());
  std::string path;
  try {
    cjson own = detail::write_rank_shard(tmp, 0, o.world, save);
    detail::write_replicated(tmp, save);
    std::vector<cjson> ranks = o.world > 1 ? collect_ranks(*o.store, keys, o.world, std::move(own), o.timeout, name)
                                           : std::vector<cjson>{std::move(own)};
    path = detail::commit_sharded_checkpoint(dir, tmp, detail::build_sharded_index(ranks, save, o.world), o.keep_last);
  } catch (const Error& e) {
    std::error_code ec;
    cfs::remove_all(tmp, ec);
    if (o.store) {
      try {
        o.store->set(keys.result(), "error " + e.message());
      } catch (const Error&) {
        // The store is gone too: the other ranks time out and say so.
      }
    }
    throw;
  }
  if (o.store) o.store->set(keys.result(), "ok " + path);
  return path;
}

std::string other_rank_save(const std::string& dir, const ShardedSave& save, const ShardedSaveOptions& o,
                            const CommitKeys& keys) {
  const std::string name = checkpoint_name(save.state.step);
  try {
    o.store->wait({keys.dir()}, o.timeout);
  } catch (const DistError& e) {
    CHORUS_THROW(IOError, "rank ", o.rank, ": rank 0 did not start saving ", name, ": ", e.message());
  }
  const std::string tmp_name = o.store->get(keys.dir());
  if (!tmp_name.empty()) {
    cjson report;
    try {
      report = {{"ok", true}, {"shard", detail::write_rank_shard((cfs::path(dir) / tmp_name).string(), o.rank, o.world, save)}};
    } catch (const Error& e) {
      report = {{"ok", false}, {"error", e.message()}};
    }
    o.store->set(keys.rank(o.rank), report.dump());
    o.store->add(keys.done(), 1);
    if (!report["ok"].get<bool>()) CHORUS_THROW(IOError, "rank ", o.rank, ": ", report["error"].get<std::string>());
  }
  // Rank 0 may wait a whole timeout for the slowest rank and then commit.
  try {
    o.store->wait({keys.result()}, 2 * o.timeout);
  } catch (const DistError& e) {
    CHORUS_THROW(IOError, "rank ", o.rank, ": rank 0 did not report the commit of ", name, ": ", e.message());
  }
  const std::string result = o.store->get(keys.result());
  if (result.rfind("ok ", 0) != 0)
    CHORUS_THROW(IOError, "rank ", o.rank, ": rank 0 could not commit ", name, ": ",
                 result.rfind("error ", 0) == 0 ? result.substr(6) : result);
  return result.substr(3);
}

}  // namespace

std::string save_sharded_checkpoint(const std::string& dir, const ShardedSave& save, const ShardedSaveOptions& o) {
  CHORUS_CHECK(o.world >= 1 && o.rank >= 0 && o.rank < o.world, "save_sharded_checkpoint: rank ", o.rank,
               " of a world of ", o.world);
  CHORUS_CHECK(o.store || o.world == 1, "save_sharded_checkpoint: a world of ", o.world, " needs the job's store");
  CHORUS_CHECK(o.keep_last >= 0, "save_sharded_checkpoint: keep_last must be >= 0 (0 keeps all), got ", o.keep_last);
  CHORUS_CHECK(save.state.step >= 0, "save_sharded_checkpoint: step must be >= 0, got ", save.state.step);
  const CommitKeys keys(o.key_prefix, save.state.step);
  return o.rank == 0 ? rank0_save(dir, save, o, keys) : other_rank_save(dir, save, o, keys);
}

}  // namespace chorus::io
